"""The collectives of tensor and data parallelism: the only module that calls torch.distributed's collectives.

Tensor parallelism (``tensor_parallel/mappings.py``, ``cross_entropy.py``, ``data.py``) and data parallelism
(the gradient buffers, ``finalize_model_grads``, the gradient clipping and the distributed optimizer) both use
these functions. Every one takes the process group; a group of ``None`` or of size 1 makes it the identity (no
communication, no ``torch.distributed`` needed).

Asynchronous calls (``async_op=True``) return a :class:`Pending`; its ``wait()`` blocks until the collective is
done, runs its finishing step once (e.g. copying an emulated result into place) and returns the result.
Synchronous calls return the result directly.

Dimension-0 collectives (all-gather, reduce-scatter) run natively (``all_gather_into_tensor``,
``reduce_scatter_tensor``) on NCCL with CUDA tensors. Elsewhere (gloo on the CPU) the all-gather fills a list of
chunks, and the reduce-scatter is emulated by an all-reduce of a copy of the input followed by keeping this
rank's chunk: the same sums (in the all-reduce's order), and the one emulation both parallelisms use.

``count_collectives()`` counts the calls issued inside a ``with`` block, by kind, so tests can check the
communication a layer or a schedule does.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

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


class Pending:
    """A launched collective. ``wait()`` blocks until it is done, runs ``finish`` (if any) once and returns its
    result (the collective's output tensor, or None); later calls return the same result."""

    def __init__(self, work, finish: Optional[Callable[[], Optional[torch.Tensor]]] = None,
                 result: Optional[torch.Tensor] = None):
        self._work, self._finish, self._result = work, finish, result

    def wait(self) -> Optional[torch.Tensor]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``group``; 1 when ``group`` is ``None`` or torch.distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank inside ``group``; 0 for a trivial group."""
    if group_size(group) == 1:
        return 0
    return dist.get_rank(group)


def backend_of(group: dist.ProcessGroup) -> str:
    """The backend name of ``group``, lower case (it may name several, e.g. ``cpu:gloo,cuda:nccl``)."""
    return str(dist.get_backend(group)).lower()


def _native_dim0(group: dist.ProcessGroup, x: torch.Tensor) -> bool:
    """True when ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are used: NCCL with CUDA tensors."""
    return x.is_cuda and "nccl" in backend_of(group)


def _done(result: Optional[torch.Tensor], async_op: bool):
    return Pending(None, result=result) if async_op else result


def all_reduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], op=dist.ReduceOp.SUM,
               async_op: bool = False):
    """In-place reduction of ``tensor`` over ``group``; returns ``tensor`` (a ``Pending`` with ``async_op``)."""
    if group_size(group) == 1:
        return _done(tensor, async_op)
    _record("all_reduce")
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return Pending(work, result=tensor) if async_op else tensor


def all_gather_dim0(x: torch.Tensor, group: Optional[dist.ProcessGroup], out: Optional[torch.Tensor] = None,
                    async_op: bool = False):
    """Every rank's ``x`` (same shape on all ranks) concatenated along dimension 0 in group-rank order, into
    ``out`` (default a new tensor); ``out`` may be the buffer ``x`` is this rank's chunk of (an in-place
    all-gather)."""
    world = group_size(group)
    if world == 1:
        if out is not None and out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return _done(x if out is None else out, async_op)
    _record("all_gather")
    x = x.contiguous()
    if out is None:
        out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if _native_dim0(group, x):
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    else:
        if out.data_ptr() <= x.data_ptr() < out.data_ptr() + out.numel() * out.element_size():
            x = x.clone()  # gloo may not tolerate the input aliasing the output
        work = dist.all_gather(list(out.chunk(world, dim=0)), x, group=group, async_op=async_op)
    return Pending(work, result=out) if async_op else out


def reduce_scatter_dim0(x: torch.Tensor, group: Optional[dist.ProcessGroup], out: Optional[torch.Tensor] = None,
                        op=dist.ReduceOp.SUM, async_op: bool = False):
    """This rank's chunk of dimension 0 (``x.shape[0] / world`` rows) of the reduction of ``x`` over ``group``,
    into ``out`` (default a new tensor); ``out`` may be this rank's chunk of ``x`` itself (an in-place
    reduce-scatter of a buffer). ``x`` is otherwise left unchanged."""
    world = group_size(group)
    if world == 1:
        if out is not None and out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return _done(x if out is None else out, async_op)
    if x.shape[0] % world != 0:
        raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by the group size {world}")
    _record("reduce_scatter")
    x = x.contiguous()
    if out is None:
        out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if _native_dim0(group, x):
        work = dist.reduce_scatter_tensor(out, x, op=op, group=group, async_op=async_op)
        return Pending(work, result=out) if async_op else out
    full = x.clone()  # emulated: all-reduce a copy, keep this rank's chunk
    work = dist.all_reduce(full, op=op, group=group, async_op=async_op)
    rank = dist.get_rank(group)

    def finish() -> torch.Tensor:
        return out.copy_(full.chunk(world, dim=0)[rank])

    return Pending(work, finish) if async_op else finish()


def broadcast(x: torch.Tensor, src: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Broadcast ``x`` in place from global rank ``src`` to every rank of ``group``; returns ``x``."""
    if group_size(group) > 1:
        _record("broadcast")
        dist.broadcast(x, src=src, group=group)
    return x


def buffer_shard(flat: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's contiguous ``1/size`` of the flat buffer ``flat`` (the whole buffer for a trivial group)."""
    size = group_size(group)
    n = flat.numel() // size
    rank = group_rank(group)
    return flat[rank * n:(rank + 1) * n]


def reduce_scatter_in_place(flat: torch.Tensor, group: Optional[dist.ProcessGroup], op=dist.ReduceOp.SUM,
                            async_op: bool = False):
    """Reduce the flat buffer ``flat`` over ``group`` so that this rank's shard (``buffer_shard``) holds the
    result; the rest of ``flat`` is left unspecified. Returns the shard (a ``Pending`` with ``async_op``)."""
    return reduce_scatter_dim0(flat, group, out=buffer_shard(flat, group), op=op, async_op=async_op)


def all_gather_in_place(flat: torch.Tensor, group: Optional[dist.ProcessGroup], async_op: bool = False):
    """Fill the flat buffer ``flat`` from every rank's shard of it (``buffer_shard``). Returns ``flat`` (a
    ``Pending`` with ``async_op``)."""
    return all_gather_dim0(buffer_shard(flat, group), group, out=flat, async_op=async_op)
