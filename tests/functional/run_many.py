"""Run several pretraining jobs one after another in one process, or in every rank of one torchrun.

The functional tests compare many short runs. Started one by one, each pays the start-up of Python, torch and
the process group (seconds per process on a 2-core machine, far more than its 10 tiny iterations); here a
group of runs of the same world size shares one start-up. Every run goes through the entry point's ``main(argv)``
exactly as ``pretrain_gpt.py ARGS`` does, and writes its own output files:

    python tests/functional/run_many.py JOBS.json
    python -m torch.distributed.run --nproc_per_node 4 tests/functional/run_many.py JOBS.json

JOBS.json: {"script": "pretrain_gpt.py", "runs": [{"argv": [...], "out": "/folder/run0"}, ...]}; run ``i`` writes
``<out>.rank<R>.stdout`` and ``<out>.rank<R>.stderr`` on each rank R. The first run that fails ends the process
with its traceback in its ``.stderr`` file (torchrun then stops the other ranks).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_entry_point(script: str):
    spec = importlib.util.spec_from_file_location("entry_point", os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _point_output_to(out: str, rank: str) -> None:
    """Send file descriptors 1 and 2 (print, warnings and C-level output alike) to this run's files."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, suffix in ((1, "stdout"), (2, "stderr")):
        target = os.open(f"{out}.rank{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def main(jobs_file: str) -> int:
    with open(jobs_file) as f:
        jobs = json.load(f)
    sys.path.insert(0, ROOT)
    entry = _load_entry_point(jobs["script"])
    import torch.distributed as dist

    rank = os.environ.get("RANK", "0")
    try:
        for run in jobs["runs"]:
            _point_output_to(run["out"], rank)
            try:
                entry.main(run["argv"])
                if dist.is_initialized():
                    dist.barrier()  # the next run starts on every rank together
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                return 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: run_many.py JOBS.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
