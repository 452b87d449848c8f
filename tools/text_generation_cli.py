"""Interactive client of the generation server.

    python tools/text_generation_cli.py localhost:5000 [--tokens-to-generate 64] [--top-p 0.9] [--greedy]

Reads a prompt per line, sends it to ``PUT /api`` and prints the continuation; an empty line or end of input
quits. A server that cannot be reached ends the client at once (exit status 1); a request the server refuses is
reported and the next prompt is read, and the exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


class ServerUnreachable(RuntimeError):
    """No answer from the address at all (refused, unknown host, timed out)."""


def put_api(address: str, payload: dict, timeout: float = 600.0) -> dict:
    """Send ``payload`` to ``http://address/api``; returns the decoded answer or raises ``RuntimeError``."""
    req = urllib.request.Request(f"http://{address}/api", data=json.dumps(payload).encode("utf-8"), method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise RuntimeError(f"server answered {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise ServerUnreachable(f"cannot reach http://{address}: {exc.reason}") from None
    except OSError as exc:  # a timeout or a connection reset while reading the answer
        raise ServerUnreachable(f"no answer from http://{address}: {exc}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Interactive client of tools/run_text_generation_server.py")
    p.add_argument("address", help="HOST:PORT of the server")
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    if ":" not in args.address:
        p.error(f"address must be HOST:PORT, got {args.address!r}")
    interactive = sys.stdin.isatty()
    sent = failed = 0
    while True:
        if interactive:
            print("Enter prompt (empty line quits): ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            break
        payload = {"prompts": [line.rstrip("\n")], "tokens_to_generate": args.tokens_to_generate}
        if args.greedy:
            payload["temperature"] = 0.0
        else:
            payload.update(temperature=args.temperature, top_k=args.top_k, top_p=0.0 if args.top_k else args.top_p)
        if args.seed is not None:
            payload["random_seed"] = args.seed
        sent += 1
        try:
            answer = put_api(args.address, payload)
        except ServerUnreachable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except RuntimeError as exc:
            failed += 1
            print(f"error: {exc}", file=sys.stderr)
            continue
        print(answer["text"][0], flush=True)
    if failed:
        print(f"error: {failed} of {sent} requests failed", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
