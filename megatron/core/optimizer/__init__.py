"""Optimizers: mixed precision with fp32 main params, loss scaling, the distributed optimizer, grad clipping."""

from megatron.core.optimizer.factory import build_param_groups, get_megatron_optimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.memory import optimizer_memory_report
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer, MixedPrecisionOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig

__all__ = [
    "OptimizerConfig", "get_megatron_optimizer", "build_param_groups", "optimizer_memory_report",
    "MegatronOptimizer", "FP32Optimizer", "MixedPrecisionOptimizer", "ConstantGradScaler", "DynamicGradScaler",
]
