"""Serve a trained checkpoint over HTTP: Megatron-LM's ``PUT /api``, OpenAI-style ``POST /v1/completions``,
``GET /health``.

    python tools/run_text_generation_server.py --load CKPT --port 5000
    torchrun --nproc_per_node 2 tools/run_text_generation_server.py --load CKPT     # tensor parallel
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
         -d '{"prompts": ["Hello"], "tokens_to_generate": 32, "top_p": 0.9}'

The server binds to 127.0.0.1 unless ``--host`` says otherwise. Under torchrun rank 0 serves and sends each
validated job to the other ranks, which run the same generation with it. The other ranks wait for jobs on a
process group of their own whose timeout is a year, so a server idle for longer than
``--distributed-timeout-minutes`` (the timeout of the collectives inside a generation) still answers. Megatron-LM's
model flags (``--num-layers``, ``--fp16``, ``--tensor-model-parallel-size``, ...) are accepted and checked against
the checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megatron.core.inference.api import Limits  # noqa: E402
from megatron.core.inference.launch import add_model_arguments, build_engine  # noqa: E402
from megatron.core.inference.server import GenerationService, make_server  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Text generation server", allow_abbrev=False)
    add_model_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=5000)
    g.add_argument("--max-prompts", type=int, default=64, help="prompts per request")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    g.add_argument("--max-pending", type=int, default=64, help="requests waiting for the model before 503")
    g.add_argument("--model-name", default=None, help="name reported by /health, /v1/models and /v1/completions")
    g.add_argument("--seed", type=int, default=None,
                   help="requests without a seed of their own draw one from a sequence started at this seed, so "
                        "a restarted server answers the same requests alike (default: a random seed each)")
    args = p.parse_args(argv)
    for name in ("max_prompts", "max_body_bytes", "max_pending"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    return args


# How long the other ranks may wait for the next job: idle time is no failure
IDLE_TIMEOUT = datetime.timedelta(days=365)


def job_group():
    """A CPU (gloo) group over every rank, with the long ``IDLE_TIMEOUT``, that carries the jobs."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def follow(engine, group) -> None:
    """Ranks other than 0: run every job rank 0 sends, until it sends ``None``."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is None:
            return
        prompts, params = box[0]
        try:
            engine.generate(prompts, params)
        except ValueError:
            pass  # rank 0 reports the same error to its client


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        engine, pstate, loaded = build_engine(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    group = job_group() if distributed else None
    if distributed and dist.get_rank() != 0:
        follow(engine, group)
        dist.destroy_process_group()
        return 0

    def send_job(prompts, params) -> None:
        dist.broadcast_object_list([(prompts, params)], src=0, group=group)

    limits = Limits(max_prompts=args.max_prompts, max_positions=engine.max_length)
    name = args.model_name or os.path.basename(os.path.normpath(args.load))
    service = GenerationService(engine, limits, model_name=name, max_pending=args.max_pending,
                                before_generate=send_job if distributed else None,
                                seeds=None if args.seed is None else random.Random(args.seed))
    server = make_server(service, args.host, args.port, max_body_bytes=args.max_body_bytes)
    host, port = server.server_address[:2]
    print(f"> serving {args.load} (iteration {loaded.iteration}, {pstate.describe()}) on http://{host}:{port}",
          flush=True)
    def _stop(signum, frame):  # SIGTERM ends the server as Ctrl-C does: the other ranks are told to stop
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if distributed:
            dist.broadcast_object_list([None], src=0, group=group)
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
