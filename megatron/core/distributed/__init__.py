"""Data parallelism: the DDP wrapper with its contiguous grad buffer, and grad finalisation."""

from megatron.core.distributed.ddp_config import DDPConfig
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["DDPConfig", "DistributedDataParallel", "finalize_model_grads"]
