"""Collectives used by the gradient and parameter buffers, with gloo-compatible fallbacks.

Every helper returns a handle with ``wait()`` (``None``-safe through :class:`Pending`), so callers can launch
asynchronously and wait later. On NCCL the reduce-scatter and all-gather run in place on the bucket; on other
backends a separate output is used and copied back when the handle is waited on. Where a backend lacks
reduce-scatter, it is emulated by an all-reduce of the whole bucket (the owned shard is then exact, and the
rest holds the full reduction too, which is harmless).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_HAS_REDUCE_SCATTER = {}  # backend name -> bool, learned on first use


class Pending:
    """A launched collective plus an optional callback run once after it completes."""

    def __init__(self, work, then: Optional[Callable[[], None]] = None):
        self.work, self.then = work, then

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.then is not None:
            then, self.then = self.then, None
            then()


def group_size(group) -> int:
    """Size of ``group``; ``None`` means a single process."""
    return 1 if group is None else dist.get_world_size(group)


def backend_of(group) -> str:
    return str(dist.get_backend(group)).lower()


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False) -> Pending:
    """In-place all-reduce of ``tensor`` over ``group`` (identity for a group of one)."""
    if group_size(group) == 1:
        return Pending(None)
    return Pending(dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def reduce_scatter_inplace(bucket: torch.Tensor, rank: int, group, async_op: bool = True,
                           op=dist.ReduceOp.SUM) -> Pending:
    """Reduce ``bucket`` [n] over ``group`` so that this rank's shard ``bucket[rank*n/g:(rank+1)*n/g]`` holds the result.

    The rest of ``bucket`` is left unspecified (local partial sums on NCCL). ``op`` other than SUM (AVG) is
    only used on NCCL.
    """
    size = group_size(group)
    if size == 1:
        return Pending(None)
    shard = bucket.numel() // size
    out = bucket[rank * shard:(rank + 1) * shard]
    backend = backend_of(group)
    if backend == "nccl":
        return Pending(_reduce_scatter(out, bucket, op=op, group=group, async_op=async_op))
    if _HAS_REDUCE_SCATTER.get(backend, True):
        tmp = torch.empty_like(out)
        try:
            work = _reduce_scatter(tmp, bucket, group=group, async_op=async_op)
            _HAS_REDUCE_SCATTER[backend] = True
            return Pending(work, lambda: out.copy_(tmp))
        except (RuntimeError, NotImplementedError):
            _HAS_REDUCE_SCATTER[backend] = False
    return Pending(dist.all_reduce(bucket, group=group, async_op=async_op))


def all_gather_inplace(bucket: torch.Tensor, rank: int, group, async_op: bool = True) -> Pending:
    """Fill ``bucket`` [n] from every rank's shard ``bucket[r*n/g:(r+1)*n/g]`` (all-gather in place)."""
    size = group_size(group)
    if size == 1:
        return Pending(None)
    shard = bucket.numel() // size
    inp = bucket[rank * shard:(rank + 1) * shard]
    if backend_of(group) != "nccl":
        inp = inp.clone()  # gloo may not tolerate the input aliasing the output
    try:
        return Pending(_all_gather(bucket, inp, group=group, async_op=async_op))
    except (RuntimeError, NotImplementedError):
        parts = list(bucket.chunk(size))
        return Pending(dist.all_gather(parts, inp, group=group, async_op=async_op))
