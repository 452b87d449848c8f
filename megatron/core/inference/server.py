"""HTTP generation server on the standard library's ``ThreadingHTTPServer``.

Endpoints: ``PUT /api`` (Megatron-LM's text generation API), ``POST /v1/completions`` (OpenAI-style),
``GET /v1/models`` (the one model served), ``GET /health``. Each connection has its own thread, which reads and validates its request; generation itself
runs one request at a time under a lock (requests wait their turn in arrival order of the lock, at most
``max_pending`` of them, beyond which the server answers 503). A bad request gets a 4xx with
``{"error": {"message": ..., "type": ...}, "message": ...}`` and never reaches the model; an unexpected failure answers 500 and
the server goes on.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from megatron.core.inference.api import (
    Limits,
    RequestError,
    completions_response,
    megatron_response,
    parse_completions_request,
    parse_megatron_request,
)


def _reject_constant(name: str):
    raise RequestError(f"invalid JSON: {name} is not a number")


def _check_text(value) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (JSON's ``"\\ud800"``): it is no Unicode text, so it can
    neither be tokenized nor written back as UTF-8. Walks the decoded body without recursion."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RequestError(f"invalid JSON string: lone surrogate {v[exc.start]!a} at character "
                                   f"{exc.start} (not Unicode text)") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


class GenerationService:
    """Validates requests and runs them on the engine one at a time.

    ``before_generate(prompts, params)``, when given, is called under the lock before the engine runs (the
    tensor-parallel server uses it to send the job to the other ranks). ``seeds``, when given, supplies the seed
    of each request that has none, in the order the requests reach the model.
    """

    def __init__(self, engine, limits: Limits, model_name: str = "megatron-lite", max_pending: int = 64,
                 before_generate: Optional[Callable] = None, log: Callable[[str], None] = print,
                 seeds: Optional[random.Random] = None):
        self.engine, self.limits, self.model_name = engine, limits, model_name
        self.tokenizer = engine.tokenizer
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_pending)
        self.before_generate = before_generate
        self.log = log
        self.seeds = seeds
        self.created = int(time.time())
        self.served = 0

    def _run(self, job):
        if not self._slots.acquire(blocking=False):
            raise RequestError("server busy: too many requests waiting; retry later", status=503)
        try:
            with self._lock:
                if self.seeds is not None and job.params.seed is None:
                    job.params = dataclasses.replace(job.params, seed=self.seeds.randrange(2**62))
                if self.before_generate is not None:
                    self.before_generate(job.prompts, job.params)
                outputs = self.engine.generate(job.prompts, job.params)
                self.served += 1
                return outputs
        finally:
            self._slots.release()

    def megatron_api(self, body) -> dict:
        job = parse_megatron_request(body, self.tokenizer, self.limits)
        outputs = self._run(job)
        if not body.get("no_log", False):
            self.log(f"PUT /api: {len(job.prompts)} prompt(s), {sum(len(o.generated) for o in outputs)} tokens")
        return megatron_response(job, outputs, self.tokenizer)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "megatron-lite"}]}

    def completions(self, body) -> dict:
        job = parse_completions_request(body, self.tokenizer, self.limits)
        outputs = self._run(job)
        return completions_response(job, outputs, self.tokenizer, self.model_name, f"cmpl-{uuid.uuid4().hex}",
                                    int(time.time()))


class _Handler(BaseHTTPRequestHandler):
    service: GenerationService
    max_body_bytes: int
    timeout = 30  # seconds a client may take to send its request
    protocol_version = "HTTP/1.0"
    server_version = "megatron-lite"

    def log_message(self, fmt, *args):  # the service logs what matters; keep stderr quiet
        pass

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        """OpenAI's error object; the top-level ``message`` is what Megatron-LM's command-line client prints."""
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": kind, "code": status}, "message": message})

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("a Content-Length header is required", status=411)
        try:
            n = int(length)
        except ValueError:
            raise RequestError(f"invalid Content-Length {length!r}") from None
        if n < 0:
            raise RequestError(f"invalid Content-Length {length!r}")
        if n > self.max_body_bytes:
            self.close_connection = True
            raise RequestError(f"request body of {n} bytes exceeds the limit of {self.max_body_bytes}", status=413)
        raw = self.rfile.read(n)
        if len(raw) < n:
            raise RequestError(f"request body ended after {len(raw)} of {n} bytes")
        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except UnicodeDecodeError:
            raise RequestError("the request body is not UTF-8") from None
        except RequestError:
            raise
        except RecursionError:
            raise RequestError("invalid JSON: nested too deeply") from None
        except ValueError as exc:  # malformed JSON, or an integer of more digits than Python converts
            raise RequestError(f"invalid JSON: {exc}") from None
        _check_text(body)
        return body

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        routes = {("PUT", "/api"): "megatron_api", ("POST", "/api"): "megatron_api",
                  ("POST", "/v1/completions"): "completions"}
        try:
            if path in ("/health", "/v1/models"):
                if method != "GET":
                    raise RequestError(f"{method} {path}: use GET", status=405)
                self._send(200, self.service.models() if path == "/v1/models" else
                           {"status": "ok", "model": self.service.model_name, "served": self.service.served})
                return
            if (method, path) not in routes:
                known = {p for _, p in routes}
                status = 405 if path in known else 404
                raise RequestError(f"{method} {path}: no such endpoint (PUT /api, POST /v1/completions, "
                                   "GET /v1/models, GET /health)", status=status)
            body = self._read_json()
            self._send(200, getattr(self.service, routes[(method, path)])(body))
        except RequestError as exc:
            self._error_if_connected(exc.status, str(exc))
        except ValueError as exc:  # the engine's own checks
            self._error_if_connected(400, str(exc))
        except (TimeoutError, ConnectionError):
            self.close_connection = True
        except Exception as exc:  # keep serving; report the failure to the client and the log
            self.service.log(f"internal error: {traceback.format_exc()}")
            self._error_if_connected(500, f"internal error: {type(exc).__name__}: {exc}")

    def _error_if_connected(self, status: int, message: str) -> None:
        """Answer with an error, unless the client has already gone (a truncated body, a closed socket)."""
        try:
            self._error(status, message)
        except OSError:
            self.close_connection = True

    def do_GET(self):
        self._dispatch("GET")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")


def make_server(service: GenerationService, host: str = "127.0.0.1", port: int = 5000,
                max_body_bytes: int = 1 << 20) -> ThreadingHTTPServer:
    """A server bound to ``host:port`` (port 0 picks a free one); call ``serve_forever()`` on it."""
    handler = type("GenerationHandler", (_Handler,), {"service": service, "max_body_bytes": max_body_bytes})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
