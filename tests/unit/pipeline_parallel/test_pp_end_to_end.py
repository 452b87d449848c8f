"""Pipelined schedules on real processes (gloo): losses and gradients equal the single-process reference.

The toy model is a stack of Linear+tanh layers split into stages with ``layers_for_stage``; each test body
runs several layouts in one process group to keep the number of spawned worlds small.
"""

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining, get_forward_backward_func
from tests.dist_utils import run_distributed
from tests.unit.pipeline_parallel.toy_model import (
    HIDDEN, MBS, SEQ, build_chunks, forward_step_func, full_layers, make_batches, reference_step,
)

ATOL = 1e-6


def _check_grads(chunks, ref_grads, scale=1.0, atol=ATOL):
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            i, rest = name.split(".")[1], name.split(".", 2)[2]
            ref = ref_grads[f"layers.{chunk.offset + int(i)}.{rest}"]
            torch.testing.assert_close(p.grad, scale * ref, rtol=0, atol=atol, msg=f"grad of {name}")


class SyncLog:
    """One no_sync factory per chunk that records, per backward, whether the chunk was inside no_sync."""

    def __init__(self, chunks):
        self.inside = [False] * len(chunks)
        self.log = [[] for _ in chunks]
        for c, chunk in enumerate(chunks):
            chunk.register_full_backward_hook(lambda m, gi, go, c=c: self.log[c].append(self.inside[c]))

    def factory(self, c):
        @contextlib.contextmanager
        def no_sync():
            self.inside[c] = True
            try:
                yield
            finally:
                self.inside[c] = False
        return no_sync


def _run_layout(pstate, num_chunks, num_microbatches, forward_only, dtype=torch.float32):
    """Run one step of the pipelined schedule on the toy model; compare with the one-process reference.

    fp32 must agree within 1e-6; bf16 losses exactly (same forward arithmetic) and gradients within bf16
    rounding of the per-microbatch accumulation.
    """
    pp = pstate.pp_size
    layers = full_layers(pp * num_chunks).to(dtype)
    batches = [{k: v.to(dtype) for k, v in b.items()} for b in make_batches(num_microbatches)]
    ref_losses, ref_grads = reference_step(layers, batches, backward=not forward_only)
    chunks = build_chunks(layers, pstate, num_chunks)
    scaled = []

    def grad_scale(loss):
        scaled.append(loss.item())
        return loss * 2.0

    finalized = []
    sent_outputs = []

    def recording_step(data_iterator, chunk):
        out, loss_func = forward_step_func(data_iterator, chunk)
        if not chunk.is_last:
            sent_outputs.append(out)
        return out, loss_func

    fb = get_forward_backward_func(pstate)
    assert fb is forward_backward_pipelining
    model = chunks if num_chunks > 1 else chunks[0]
    stats = fb(recording_step, [iter(batches) for _ in chunks], model, num_microbatches, SEQ, MBS, HIDDEN,
               dtype, pstate, forward_only=forward_only, grad_scale_func=grad_scale,
               finalize_grads_func=finalized.append)
    if pstate.is_pipeline_last_stage:
        assert len(stats) == num_microbatches
        assert max(abs(s["loss"].item() - l) for s, l in zip(stats, ref_losses)) <= ATOL
    else:
        assert stats == []
    if forward_only:
        assert finalized == [] and scaled == []
        assert all(p.grad is None for chunk in chunks for p in chunk.parameters())
        return
    assert len(finalized) == 1 and finalized[0] == chunks
    _check_grads(chunks, ref_grads, scale=2.0, atol=ATOL if dtype == torch.float32 else 2e-2)
    # every output sent downstream was freed once sent (Megatron's deallocation trick)
    assert len(sent_outputs) == num_microbatches * sum(not c.is_last for c in chunks)
    assert all(out.numel() == 1 for out in sent_outputs)
    for c, chunk in enumerate(chunks):
        stage = c * pp + pstate.pp_rank
        assert chunk.set_input_calls == (0 if stage == 0 else num_microbatches)


def _body_pp(rank, world_size, cases):
    for pp, num_chunks, num_microbatches, forward_only in cases:
        pstate = ParallelState.build(1, pp, num_chunks if num_chunks > 1 else None)
        _run_layout(pstate, num_chunks, num_microbatches, forward_only)


def _body_world2(rank, world_size):
    _body_pp(rank, world_size, [(2, 1, 4, False), (2, 1, 1, False), (2, 2, 4, False), (2, 2, 2, False),
                                (2, 1, 3, True), (2, 2, 4, True)])
    _run_layout(ParallelState.build(1, 2, 2), 2, 4, False, dtype=torch.bfloat16)  # bf16 on the wire


def test_pp2_plain_and_interleaved():
    """PP=2 plain (M=4, M=1), interleaved (M=4, M=2), forward-only of both, and interleaved in bf16."""
    run_distributed(_body_world2, 2)


def _body_dp_pp(rank, world_size, num_microbatches, num_chunks):
    """DP=2 x PP=2: each replica accumulates its own microbatches; finalize all-reduces once per step.

    With 2 chunks ``no_sync_func`` is a list (one per chunk); with 1 chunk a single factory.
    """
    pstate = ParallelState.build(1, 2)
    layers = full_layers(4)
    my_batches = make_batches(num_microbatches, dp_rank=pstate.dp_rank)
    all_batches = make_batches(num_microbatches, dp_rank=0) + make_batches(num_microbatches, dp_rank=1)
    _, ref_grads = reference_step(layers, all_batches)  # mean over both replicas' microbatches
    chunks = build_chunks(layers, pstate, num_chunks)
    pstate_v = dataclasses.replace(pstate, vpp_size=num_chunks if num_chunks > 1 else None)
    sync = SyncLog(chunks)
    no_sync = [sync.factory(c) for c in range(num_chunks)] if num_chunks > 1 else sync.factory(0)
    calls = []

    def finalize(model):
        calls.append(len(model))
        for chunk in model:
            for p in chunk.parameters():
                dist.all_reduce(p.grad, group=pstate.dp_group)
                p.grad /= pstate.dp_size

    stats = forward_backward_pipelining(
        forward_step_func, [iter(my_batches) for _ in chunks], chunks, num_microbatches, SEQ, MBS, HIDDEN,
        torch.float32, pstate_v, no_sync_func=no_sync, finalize_grads_func=finalize,
    )
    assert calls == [num_chunks]
    assert len(stats) == (num_microbatches if pstate.is_pipeline_last_stage else 0)
    _check_grads(chunks, ref_grads)
    # every backward of a chunk but its last ran under that chunk's no_sync
    for log in sync.log:
        assert log == [True] * (num_microbatches - 1) + [False]


def _body_tp_sp_pp(rank, world_size, num_chunks, num_microbatches):
    """TP=2 x PP=2 with sequence parallelism: stages exchange [s/tp, b, h] shards between matching TP ranks.

    The toy layers act per token, so each TP rank runs the stage on its slice of the sequence; its loss is
    the mean over its slice and the gradients of the full-sequence mean are the TP average (finalize).
    """
    pstate = ParallelState.build(2, 2, num_chunks if num_chunks > 1 else None)
    tp, r = pstate.tp_size, pstate.tp_rank
    layers = full_layers(2 * num_chunks)
    batches = make_batches(num_microbatches)
    ref_losses, ref_grads = reference_step(layers, batches)
    shards = [{k: v.chunk(tp, dim=0)[r] for k, v in b.items()} for b in batches]  # [s/tp, b, h]
    chunks = build_chunks(layers, pstate, num_chunks)

    def finalize(model):
        for chunk in model:
            for p in chunk.parameters():
                dist.all_reduce(p.grad, group=pstate.tp_group)
                p.grad /= tp

    stats = forward_backward_pipelining(
        forward_step_func, [iter(shards) for _ in chunks], chunks, num_microbatches, SEQ, MBS, HIDDEN,
        torch.float32, pstate, sequence_parallel=True, finalize_grads_func=finalize,
    )
    if pstate.is_pipeline_last_stage:
        losses = torch.stack([s["loss"] for s in stats])
        dist.all_reduce(losses, group=pstate.tp_group)
        assert (losses / tp - torch.tensor(ref_losses)).abs().max() <= ATOL
    _check_grads(chunks, ref_grads)


def _body_world4(rank, world_size):
    _body_pp(rank, world_size, [(4, 1, 6, False), (4, 1, 2, False), (4, 2, 4, False), (4, 1, 5, True)])
    _body_dp_pp(rank, world_size, 4, 2)
    _body_dp_pp(rank, world_size, 3, 1)
    _body_tp_sp_pp(rank, world_size, 1, 3)
    _body_tp_sp_pp(rank, world_size, 2, 4)


def test_pp4_dp2_pp2_and_tp2_pp2_sp():
    """PP=4 (plain, fewer microbatches than stages, interleaved, forward-only); DP=2 x PP=2 (2 chunks and 1)
    with finalize_grads_func called once; TP=2 x PP=2 with sequence parallelism (plain and interleaved)."""
    run_distributed(_body_world4, 4)
