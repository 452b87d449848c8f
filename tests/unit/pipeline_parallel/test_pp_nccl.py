"""The CUDA paths of the pipeline schedules (skipped without GPUs; the gloo tests cover the same logic).

* two GPUs: NCCL batched isend/irecv between stages, PP=2 plain, interleaved and forward-only;
* one GPU: two processes sharing it over gloo, so activations live on the GPU and travel through host memory.

Losses and gradients are compared with the single-process CPU reference (fp32, TF32 off).
"""

import pytest
import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining
from tests.dist_utils import run_distributed
from tests.unit.pipeline_parallel.toy_model import (
    HIDDEN, MBS, SEQ, build_chunks, forward_step_func, full_layers, make_batches, reference_step,
)

WORLD = 2


def _body(rank, world_size, backend):
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.backends.cuda.matmul.allow_tf32 = False
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


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pp2_nccl():
    run_distributed(_body, WORLD, args=("nccl",), backend="nccl", cuda=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pp2_gloo_with_cuda_activations():
    run_distributed(_body, WORLD, args=("gloo",), cuda=True)
