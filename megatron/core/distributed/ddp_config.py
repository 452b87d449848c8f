"""Configuration of the data-parallel wrapper (the ``--ddp-*`` and ``--overlap-grad-reduce`` flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DDPConfig:
    """How :class:`DistributedDataParallel` keeps and reduces gradients.

    grad_reduce_in_fp32: the main-grad buffer is fp32 whatever the parameter dtype (bf16/fp16 grads
        accumulate and are reduced in fp32); ``False`` keeps the buffer in the parameter dtype.
    overlap_grad_reduce: launch each bucket's reduction asynchronously as soon as all its grads are final
        during the last microbatch's backward (``--overlap-grad-reduce``).
    use_distributed_optimizer: reduce-scatter the buckets instead of all-reducing them, and keep a contiguous
        parameter buffer that the distributed optimizer all-gathers into (``--use-distributed-optimizer``).
    bucket_size: elements per bucket (``--ddp-bucket-size``); ``None`` puts every parameter in one bucket.
    average_in_collective: average with the collective itself (``ReduceOp.AVG``, NCCL only) instead of
        pre-dividing the buffer by the data-parallel size.
    """

    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: Optional[int] = None
    average_in_collective: bool = False

    def __post_init__(self) -> None:
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be a positive number of elements, got {self.bucket_size}")
