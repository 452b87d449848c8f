"""The contiguous main-grad buffer, its buckets, and (for the distributed optimizer) the parameter buffer.

Layout: the parameters of one dtype are laid out in *reverse* registration order (roughly the order their
gradients become final in backward), each occupying ``[start, end)`` of one flat buffer, ``start`` a multiple
of ``PARAM_ALIGN`` elements. Consecutive
parameters are grouped into buckets of at least ``bucket_size`` elements (one bucket when ``None``); a
parameter never straddles two buckets. Under the distributed optimizer every bucket is padded to a multiple
of ``128 * dp_size`` elements and DP rank ``r`` owns the contiguous range
``[bucket.start + r * shard, bucket.start + (r + 1) * shard)`` of each bucket (with one bucket: a contiguous
1/DP range of the buffer); a parameter that crosses a shard boundary is split by element range.

Each parameter's range is its ``main_grad``, held with its zero state in the parameter's gradient record
(``megatron/core/grad_record.py``); ``zero_grads`` clears the buffer and marks every record zero at the start of an
iteration. The padding is zero from the start and nothing writes it but reductions of zeros.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.collectives import Pending, all_gather_in_place, all_reduce, reduce_scatter_in_place
from megatron.core.grad_record import GradRecord, attach_main_grad

_SHARD_ALIGN = 128  # elements; keeps every shard start aligned for fast collectives
PARAM_ALIGN = 16  # elements; every parameter's range starts at a multiple of this (cuBLAS wants 16-byte-aligned
# operands: a 2-element bias, such as BERT's binary head, would otherwise misalign every range after it and push the
# weight-gradient GEMMs that accumulate into those ranges onto slow unaligned kernels)


def align_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


class Bucket:
    """A contiguous range of the buffer whose reduction is launched as one collective."""

    def __init__(self, index: int, params: List[torch.nn.Parameter], start: int, end: int,
                 grad_data: torch.Tensor, param_data: Optional[torch.Tensor]):
        self.index = index
        self.params = params
        self.start, self.end = start, end  # element range in the buffer, padding included
        self.grad_data = grad_data  # [end - start] view of the grad buffer
        self.param_data = param_data  # [end - start] view of the param buffer (distributed optimizer)
        self.ready: set = set()  # params whose grads are final in this backward (overlap mode)
        self.grad_handle: Optional[Pending] = None
        self.param_handle: Optional[Pending] = None

    @property
    def numel(self) -> int:
        return self.end - self.start


class GradBuffer:
    """Main grads (and optionally params) of parameters of one dtype, in one flat tensor.

    Each parameter's gradient record gets ``main_grad``, a view of its range shaped like the parameter (also
    ``param.main_grad``). With
    ``make_param_buffer`` the parameter data is moved into a flat buffer of the parameter dtype with the
    same layout (``param.data`` becomes a view), so the distributed optimizer can all-gather in place.
    """

    def __init__(self, params: List[torch.nn.Parameter], grad_dtype: torch.dtype, bucket_size: Optional[int],
                 dp_size: int, shard: bool, make_param_buffer: bool):
        self.params = params  # layout order (reverse registration order)
        self.grad_dtype = grad_dtype
        self.param_dtype = params[0].dtype
        self.dp_size = dp_size
        self.sharded = shard
        device = params[0].device
        self.index: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        bucket_ranges: List[Tuple[List[torch.nn.Parameter], int, int]] = []
        offset, bucket_start, current = 0, 0, []
        for i, p in enumerate(params):
            offset = align_up(offset, PARAM_ALIGN)
            self.index[p] = (offset, offset + p.numel())
            offset += p.numel()
            current.append(p)
            last = i == len(params) - 1
            if last or (bucket_size is not None and offset - bucket_start >= bucket_size):
                end = self._pad(offset - bucket_start) + bucket_start
                bucket_ranges.append((current, bucket_start, end))
                offset = bucket_start = end
                current = []
        self.numel = offset
        self.numel_unpadded = sum(p.numel() for p in params)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)  # [numel]
        self.param_data = None
        if make_param_buffer:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)  # [numel]
        self.records: List[GradRecord] = []
        for p in params:
            s, e = self.index[p]
            self.records.append(attach_main_grad(p, self.grad_data[s:e].view(p.shape)))  # marked zero
            if self.param_data is not None:
                self.param_data[s:e].copy_(p.data.reshape(-1))
                p.data = self.param_data[s:e].view(p.shape)
        self.buckets: List[Bucket] = []
        for params_b, s, e in bucket_ranges:
            pd = self.param_data[s:e] if self.param_data is not None else None
            self.buckets.append(Bucket(len(self.buckets), params_b, s, e, self.grad_data[s:e], pd))
        self.param_to_bucket = {p: b for b in self.buckets for p in b.params}

    def zero_grads(self) -> None:
        """Clear the buffer and mark every main grad zero for a new iteration (the zero rule of
        ``grad_record.py``)."""
        self.grad_data.zero_()
        for record in self.records:
            record.is_zero = True

    def _pad(self, n: int) -> int:
        return align_up(n, _SHARD_ALIGN * self.dp_size if self.sharded else PARAM_ALIGN)

    # ---- ownership under the distributed optimizer -----------------------------------------------------
    def shard_range(self, bucket: Bucket, dp_rank: int) -> Tuple[int, int]:
        """Buffer range owned by ``dp_rank`` inside ``bucket``."""
        shard = bucket.numel // self.dp_size
        return bucket.start + dp_rank * shard, bucket.start + (dp_rank + 1) * shard

    def local_pieces(self, dp_rank: int) -> List[Tuple[torch.nn.Parameter, int, int, int, int]]:
        """``(param, buf_lo, buf_hi, p_lo, p_hi)`` for every piece of a parameter this DP rank owns.

        ``[buf_lo, buf_hi)`` is the range in the buffer and ``[p_lo, p_hi)`` the same elements in the flattened
        parameter. Pieces come in layout order.
        """
        pieces = []
        for b in self.buckets:
            own_lo, own_hi = self.shard_range(b, dp_rank)
            for p in b.params:
                s, e = self.index[p]
                lo, hi = max(s, own_lo), min(e, own_hi)
                if lo < hi:
                    pieces.append((p, lo, hi, lo - s, hi - s))
        return pieces

    # ---- gradient reduction ---------------------------------------------------------------------------
    def start_bucket_grad_sync(self, bucket: Bucket, dp_group, use_avg: bool) -> None:
        """Launch the asynchronous mean over DP of ``bucket``'s grads (all-reduce, or reduce-scatter)."""
        if bucket.grad_handle is not None:
            return
        op = dist.ReduceOp.SUM
        if self.dp_size > 1:
            if use_avg:
                op = dist.ReduceOp.AVG
            else:
                bucket.grad_data.mul_(1.0 / self.dp_size)
        if self.sharded:
            bucket.grad_handle = reduce_scatter_in_place(bucket.grad_data, dp_group, op=op, async_op=True)
        else:
            bucket.grad_handle = all_reduce(bucket.grad_data, dp_group, op=op, async_op=True)

    def finish_bucket_grad_sync(self, bucket: Bucket, dp_group, use_avg: bool) -> None:
        self.start_bucket_grad_sync(bucket, dp_group, use_avg)
        bucket.grad_handle.wait()
        bucket.grad_handle = None
        bucket.ready.clear()

    def gather_bucket_grads(self, bucket: Bucket, dp_group) -> None:
        """After a reduce-scatter, make the whole bucket's grads valid by all-gathering the reduced shards."""
        if self.sharded and self.dp_size > 1:
            all_gather_in_place(bucket.grad_data, dp_group)

    # ---- parameter all-gather (distributed optimizer) ------------------------------------------------
    def start_bucket_param_sync(self, bucket: Bucket, dp_group) -> None:
        if bucket.param_handle is None:
            bucket.param_handle = all_gather_in_place(bucket.param_data, dp_group, async_op=True)

    def finish_bucket_param_sync(self, bucket: Bucket) -> None:
        if bucket.param_handle is not None:
            bucket.param_handle.wait()
            bucket.param_handle = None
