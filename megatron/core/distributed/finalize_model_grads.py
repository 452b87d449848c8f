"""Everything that must happen to the grads between the last backward and the optimizer step."""

from __future__ import annotations

from typing import List

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.collectives import all_reduce, group_size
from megatron.core.grad_record import main_grad_of


def _grad(p: torch.nn.Parameter):
    """The grad to reduce: ``main_grad`` under DDP, else ``.grad`` (an unwrapped module)."""
    g = main_grad_of(p)
    return g if g is not None else p.grad


def _all_reduce_coalesced(grads: List[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` with one collective (flatten, all-reduce, copy back)."""
    if not grads or group_size(group) == 1:
        return
    flat = _flatten_dense_tensors(grads)  # [sum numel]
    all_reduce(flat, group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def finalize_model_grads(model_chunks, pstate) -> None:
    """Finish the DP reduction, then the TP and embedding-group sums of the grads that need them.

    Chunks are normally :class:`DistributedDataParallel`; an unwrapped module skips step 1 and has its
    ``.grad`` reduced in steps 2 and 3.

    1. ``finish_grad_sync()`` on every chunk: mean over DP (all-reduce, or reduce-scatter under the
       distributed optimizer).
    2. Params with ``sequence_parallel=True`` (LayerNorm weights/biases, row-parallel bias under SP) saw only
       this rank's sequence slice: their ``main_grad`` is summed over ``pstate.tp_group``. Buffer layouts are
       identical across TP ranks, so a reduce-scattered buffer stays consistent.
    3. With ``pp > 1`` the tied word embedding lives on the first and last stage (``shared_embedding=True``):
       its ``main_grad`` is summed over ``pstate.embedding_group``. The two stages have different buffer
       layouts, so under the distributed optimizer the whole grad is made valid (all-gathered over DP) first.
    """
    for chunk in model_chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()

    if pstate.tp_size > 1:
        sp_grads = [_grad(p) for chunk in model_chunks for p in chunk.parameters()
                    if p.requires_grad and getattr(p, "sequence_parallel", False) and _grad(p) is not None]
        _all_reduce_coalesced(sp_grads, pstate.tp_group)

    if pstate.pp_size > 1 and pstate.embedding_group is not None and len(pstate.embedding_ranks) > 1:
        for chunk in model_chunks:
            shared = [p for p in chunk.parameters() if p.requires_grad and getattr(p, "shared_embedding", False)]
            if shared and hasattr(chunk, "make_full_grads"):
                chunk.make_full_grads(shared)
        emb_grads = [_grad(p) for chunk in model_chunks for p in chunk.parameters()
                     if p.requires_grad and getattr(p, "shared_embedding", False) and _grad(p) is not None]
        _all_reduce_coalesced(emb_grads, pstate.embedding_group)
