"""The CUDA paths of the pipeline schedules (skipped without GPUs; the gloo tests cover the same logic).

* two GPUs: NCCL batched isend/irecv between stages, PP=2 plain, interleaved and forward-only;
* one GPU: two processes sharing it over gloo, so activations live on the GPU and travel through host memory.

Losses and gradients are compared with the single-process CPU reference (fp32, TF32 off).
"""

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining
from tests.dist_utils import _free_port
from tests.unit.pipeline_parallel.toy_model import (
    HIDDEN, MBS, SEQ, build_chunks, forward_step_func, full_layers, make_batches, reference_step,
)

WORLD = 2


def _worker(rank, port, backend, err_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        device = torch.device("cuda", rank if backend == "nccl" else 0)
        torch.cuda.set_device(device)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=WORLD, **kwargs)
        _body(device)
        dist.barrier()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _body(device):
    for num_chunks, num_microbatches, forward_only in [(1, 4, False), (2, 4, False), (2, 2, True), (1, 3, True)]:
        pstate = ParallelState.build(1, WORLD, num_chunks if num_chunks > 1 else None)
        layers = full_layers(WORLD * num_chunks)
        batches = make_batches(num_microbatches)
        ref_losses, ref_grads = reference_step(layers, batches, backward=not forward_only)
        chunks = [c.to(device) for c in build_chunks(layers, pstate, num_chunks)]
        dev_batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
        stats = forward_backward_pipelining(
            forward_step_func, [iter(dev_batches) for _ in chunks], chunks, num_microbatches, SEQ, MBS, HIDDEN,
            torch.float32, pstate, forward_only=forward_only,
        )
        if pstate.is_pipeline_last_stage:
            assert max(abs(s["loss"].item() - l) for s, l in zip(stats, ref_losses)) < 1e-5
        if forward_only:
            continue
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                i, rest = name.split(".")[1], name.split(".", 2)[2]
                assert p.grad.device == device
                torch.testing.assert_close(p.grad.cpu(), ref_grads[f"layers.{chunk.offset + int(i)}.{rest}"],
                                           rtol=1e-5, atol=1e-5)


def _spawn(backend):
    with tempfile.TemporaryDirectory() as err_dir:
        try:
            mp.start_processes(_worker, args=(_free_port(), backend, err_dir), nprocs=WORLD, join=True,
                               start_method="spawn")
        except Exception as exc:
            msgs = [open(os.path.join(err_dir, n)).read() for n in sorted(os.listdir(err_dir))]
            raise AssertionError("distributed test failed:\n" + "\n".join(msgs)) from exc


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pp2_nccl():
    _spawn("nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pp2_gloo_with_cuda_activations():
    _spawn("gloo")
