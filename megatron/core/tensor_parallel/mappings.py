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

All communication goes through four private helpers (``_all_reduce``, ``_all_gather_dim0``,
``_reduce_scatter_dim0``, ``_broadcast``; the two dim-0 ones can run asynchronously) which record each call, so ``count_collectives()`` can count them by
kind. On NCCL the native ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are used; on gloo (CPU), which
lacks a portable reduce-scatter, the reduce-scatter is an all-reduce followed by taking the local chunk (the same
result; still counted as one ``reduce_scatter``).

The operators never modify their input or the incoming gradient in place: an all-reduce works on a fresh copy,
because autograd may hand the same gradient tensor to several branches (a residual add does).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------------------------------------------
# Communication spy
# --------------------------------------------------------------------------------------------------------------
_ACTIVE_COUNTERS: List[Counter] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the collectives issued by this process inside the ``with`` block, by kind.

    Yields a ``collections.Counter`` filled as calls happen, keyed ``"all_reduce"``, ``"all_gather"``,
    ``"reduce_scatter"`` and ``"broadcast"`` (only kinds that occurred appear). Counts include backward passes
    run inside the block. Collectives skipped because the group has size 1 are not counted. Nesting is allowed:
    every open counter sees every call.
    """
    counter: Counter = Counter()
    _ACTIVE_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTERS.remove(counter)


def _record(kind: str) -> None:
    for c in _ACTIVE_COUNTERS:
        c[kind] += 1


# --------------------------------------------------------------------------------------------------------------
# Private collective helpers (the only places that talk to torch.distributed)
# --------------------------------------------------------------------------------------------------------------
def get_group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``group``; 1 when ``group`` is ``None`` or torch.distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def get_group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank inside ``group``; 0 for a trivial group."""
    if get_group_size(group) == 1:
        return 0
    return dist.get_rank(group)


def _native_dim0_collectives(group: dist.ProcessGroup, x: torch.Tensor) -> bool:
    """True when ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are available: NCCL with CUDA tensors
    (the backend string may name several backends, e.g. ``cpu:gloo,cuda:nccl``)."""
    return x.is_cuda and "nccl" in str(dist.get_backend(group))


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Return the element-wise reduction of ``x`` over ``group`` in a new tensor (``x`` is untouched)."""
    _record("all_reduce")
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


class Pending:
    """A collective issued with ``async_op=True``; ``wait()`` blocks until it is done and returns its result."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


def _all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Concatenate every rank's ``x`` (same shape on all ranks) along dimension 0, in group-rank order.

    With ``async_op=True`` returns a ``Pending`` whose ``wait()`` gives the result."""
    _record("all_gather")
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if _native_dim0_collectives(group, x):
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    else:
        work = dist.all_gather(list(out.chunk(world, dim=0)), x, group=group, async_op=async_op)
    return Pending(work, lambda: out) if async_op else out


def _reduce_scatter_dim0(x: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Sum ``x`` over ``group`` and return this rank's chunk of dimension 0 (size ``x.shape[0] / world``).

    With ``async_op=True`` returns a ``Pending`` whose ``wait()`` gives the result."""
    _record("reduce_scatter")
    world = dist.get_world_size(group)
    _check_divisible(x.shape[0], world, "dimension 0 (sequence)")
    x = x.contiguous()
    if _native_dim0_collectives(group, x):
        out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.reduce_scatter_tensor(out, x, group=group, async_op=async_op)
        return Pending(work, lambda: out) if async_op else out
    full = x.clone()
    work = dist.all_reduce(full, group=group, async_op=async_op)
    rank = dist.get_rank(group)
    finish = lambda: full.chunk(world, dim=0)[rank].contiguous()  # noqa: E731
    return Pending(work, finish) if async_op else finish()


def _broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``x`` in place from global rank ``src`` to every rank of ``group``."""
    _record("broadcast")
    dist.broadcast(x, src=src, group=group)


def _check_divisible(size: int, world: int, what: str) -> None:
    if size % world != 0:
        raise ValueError(f"{what} of size {size} is not divisible by the tensor-parallel group size {world}")


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Keep this rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    world = dist.get_world_size(group)
    _check_divisible(x.shape[dim], world, f"dimension {dim}")
    return x.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension."""
    stacked = _all_gather_dim0(x.unsqueeze(0), group)  # [world, *x.shape]
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
        return _all_gather_dim0(grad, ctx.group), None


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
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_output_grad:
            return _reduce_scatter_dim0(grad, ctx.group), None, None
        return _split(grad, ctx.group, 0), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along dimension 0. Backward: all-gather along dimension 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


# --------------------------------------------------------------------------------------------------------------
# Public verbs
# --------------------------------------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """f: identity forward, all-reduce backward. Put before a column-parallel GEMM on a replicated input."""
    if get_group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """g: all-reduce forward, identity backward. Sums the partial outputs of a row-parallel GEMM."""
    if get_group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Split the last dimension, keep this rank's chunk; backward all-gathers the last dimension."""
    if get_group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather along the last dimension; backward keeps this rank's chunk of the gradient."""
    if get_group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``[s, ...] -> [s/tp, ...]``: keep this rank's sequence chunk; backward all-gathers dimension 0."""
    if get_group_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Optional[dist.ProcessGroup], tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """``[s/tp, ...] -> [s, ...]`` by all-gather; backward reduce-scatters (or, if
    ``tensor_parallel_output_grad`` is False, just splits) the gradient along dimension 0."""
    if get_group_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """``[s, ...]`` partial sums ``-> [s/tp, ...]`` reduced: reduce-scatter forward, all-gather backward."""
    if get_group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group)


def all_reduce_max(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise maximum over ``group`` (no autograd; used by the vocab-parallel cross-entropy)."""
    if get_group_size(group) == 1:
        return x
    return _all_reduce(x, group, op=dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise sum over ``group`` into a new tensor (no autograd)."""
    if get_group_size(group) == 1:
        return x
    return _all_reduce(x, group)


def broadcast_tensor(x: torch.Tensor, src: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Broadcast ``x`` in place from global rank ``src`` over ``group`` (no autograd); returns ``x``."""
    if get_group_size(group) > 1:
        _broadcast(x, src, group)
    return x
