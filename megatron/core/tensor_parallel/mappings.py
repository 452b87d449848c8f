"""The conjugate communication operators of tensor and sequence parallelism.

Each operator is a tiny ``torch.autograd.Function`` whose backward is the adjoint of its forward (an all-reduce
is conjugate to the identity, an all-gather to a reduce-scatter or a split). Layers use the public verbs below,
never the classes. Every verb takes ``(x, group)``; a ``group`` of ``None`` or of size 1 makes it the identity,
so a single process needs no ``torch.distributed`` at all.

| verb                                           | forward                 | backward                |
|------------------------------------------------|-------------------------|-------------------------|
| ``copy_to_tensor_model_parallel_region`` (f)   | identity                | all-reduce              |
| ``reduce_from_tensor_model_parallel_region`` (g)| all-reduce             | identity                |
| ``scatter_to_tensor_model_parallel_region``    | split last dim          | all-gather last dim     |
| ``gather_from_tensor_model_parallel_region``   | all-gather last dim     | split last dim          |
| ``scatter_to_sequence_parallel_region``        | split dim 0             | all-gather dim 0        |
| ``gather_from_sequence_parallel_region``       | all-gather dim 0        | reduce-scatter dim 0 (or split) |
| ``reduce_scatter_to_sequence_parallel_region`` | reduce-scatter dim 0    | all-gather dim 0        |

All communication goes through ``megatron/core/collectives.py``, shared with data parallelism: it counts every
call (``count_collectives()``), uses the native dimension-0 collectives on NCCL and emulates the reduce-scatter on
gloo (an all-reduce, then the local chunk: the same result, still counted as one ``reduce_scatter``).

The operators never modify their input or the incoming gradient in place: an all-reduce works on a fresh copy,
because autograd may hand the same gradient tensor to several branches (a residual add does).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.collectives import (all_gather_dim0, all_reduce, broadcast, group_rank, group_size,
                                      reduce_scatter_dim0)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The element-wise reduction of ``x`` over ``group`` in a new tensor (``x`` is untouched)."""
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group, op=op)


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Keep this rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    world = group_size(group)
    if x.shape[dim] % world != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel group "
                         f"size {world}")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension."""
    stacked = all_gather_dim0(x.unsqueeze(0), group)  # [world, *x.shape]
    return torch.cat(stacked.unbind(0), dim=-1)


# --------------------------------------------------------------------------------------------------------------
# Autograd functions: one per conjugate pair
# --------------------------------------------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    """f. Forward: identity. Backward: all-reduce (sum) of the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g. Forward: all-reduce (sum) over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dimension. Backward: all-gather along the last dimension."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather along the last dimension. Backward: keep this rank's chunk of the last dimension."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, grad.dim() - 1), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of dimension 0 (sequence). Backward: all-gather along dimension 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, 0)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Forward: all-gather along dimension 0.

    Backward: reduce-scatter along dimension 0 when the consumer of the gathered tensor is tensor-parallel
    (each rank holds a partial gradient of the full sequence, ``tensor_parallel_output_grad=True``); otherwise
    the gradient is already complete on every rank and is just split.
    """

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tp_output_grad = tensor_parallel_output_grad
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_output_grad:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return _split(grad, ctx.group, 0), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along dimension 0. Backward: all-gather along dimension 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


# --------------------------------------------------------------------------------------------------------------
# Public verbs
# --------------------------------------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """f: identity forward, all-reduce backward. Put before a column-parallel GEMM on a replicated input."""
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """g: all-reduce forward, identity backward. Sums the partial outputs of a row-parallel GEMM."""
    if group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Split the last dimension, keep this rank's chunk; backward all-gathers the last dimension."""
    if group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather along the last dimension; backward keeps this rank's chunk of the gradient."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``[s, ...] -> [s/tp, ...]``: keep this rank's sequence chunk; backward all-gathers dimension 0."""
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Optional[dist.ProcessGroup], tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """``[s/tp, ...] -> [s, ...]`` by all-gather; backward reduce-scatters (or, if
    ``tensor_parallel_output_grad`` is False, just splits) the gradient along dimension 0."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """``[s, ...]`` partial sums ``-> [s/tp, ...]`` reduced: reduce-scatter forward, all-gather backward."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group)


def all_reduce_max(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise maximum over ``group`` (no autograd; used by the vocab-parallel cross-entropy)."""
    if group_size(group) == 1:
        return x
    return _all_reduce(x, group, op=dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise sum over ``group`` into a new tensor (no autograd)."""
    if group_size(group) == 1:
        return x
    return _all_reduce(x, group)


def broadcast_tensor(x: torch.Tensor, src: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Broadcast ``x`` in place from global rank ``src`` over ``group`` (no autograd); returns ``x``."""
    return broadcast(x, src, group)
