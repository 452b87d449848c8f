"""Run a test body in several processes joined by torch.distributed (gloo on CPU by default).

    def body(rank, world_size, arg):      # module-level, so it pickles
        pstate = ParallelState.build(tensor_model_parallel_size=world_size)
        ...                                # assert freely: a failure in any rank fails the test

    run_distributed(body, world_size=4, args=(arg,))
    run_distributed(body, world_size=2, backend="nccl", cuda=True)   # one GPU per rank
    run_distributed(body, world_size=2, cuda=True)                   # gloo, every rank on GPU 0

With ``cuda=True`` each rank's current device is set before the group is created: GPU ``rank`` under NCCL
(also passed as the group's ``device_id``), GPU 0 for every rank under gloo.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, err_dir, backend, cuda):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        kwargs = {}
        if cuda:
            device = torch.device("cuda", rank if backend == "nccl" else 0)
            torch.cuda.set_device(device)
            if backend == "nccl":
                kwargs["device_id"] = device
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:  # report the failure to the parent with its traceback
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, args: tuple = (), backend: str = "gloo", cuda: bool = False) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; raise if any fails."""
    with tempfile.TemporaryDirectory() as err_dir:
        try:
            mp.start_processes(
                _worker, args=(world_size, _free_port(), fn, args, err_dir, backend, cuda), nprocs=world_size,
                join=True, start_method="spawn",
            )
        except Exception as exc:
            msgs = []
            for name in sorted(os.listdir(err_dir)):
                with open(os.path.join(err_dir, name)) as f:
                    msgs.append(f"--- {name} ---\n{f.read()}")
            raise AssertionError("distributed test failed:\n" + "\n".join(msgs)) from exc
