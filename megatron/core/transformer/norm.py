"""Normalization over the last dimension: LayerNorm (weight and bias) or RMSNorm (weight only).

Under sequence parallelism a norm's grads are partial over TP (each rank saw its own sequence slice):
``sequence_parallel = True`` on its parameters makes ``finalize_model_grads`` sum them. The per-head query/key
norms (``qk_layernorm``) see all positions but only this rank's heads, so theirs are summed too.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megatron.core.fusions import layer_norm, layer_norm_with_residual, rms_norm, rms_norm_with_residual
from megatron.core.parallel_state import default_device
from megatron.core.transformer.config import TransformerConfig


class Norm(nn.Module):
    """The parameters and options both norms share; ``size``: the normalized dimension (default hidden size).
    Each norm has ``forward(x)`` and ``with_residual(x) -> (norm(x), x)``, the second output for the residual
    branch (its gradient is added inside the fused backward)."""

    has_bias = True

    def __init__(self, config: TransformerConfig, size: Optional[int] = None, grads_partial_over_tp: bool = False):
        super().__init__()
        h, dev, dt = size or config.hidden_size, default_device(), config.params_dtype
        self.weight = nn.Parameter(torch.empty(h, device=dev, dtype=dt))
        if self.has_bias:
            self.bias = nn.Parameter(torch.empty(h, device=dev, dtype=dt))
        else:
            self.register_parameter("bias", None)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel or grads_partial_over_tp
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.use_fused = config.use_fused_kernels and config.layernorm_fusion


class LayerNorm(Norm):
    """LayerNorm over the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma, use_fused=self.use_fused)

    def with_residual(self, x: torch.Tensor):
        """``(self(x), x)``, the residual's gradient added inside the fused LayerNorm backward
        (``ops.layer_norm_with_residual``)."""
        return layer_norm_with_residual(x, self.weight, self.bias, self.eps, self.zero_centered_gamma,
                                        use_fused=self.use_fused)


class RMSNorm(Norm):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension; no bias."""

    has_bias = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma, use_fused=self.use_fused)

    def with_residual(self, x: torch.Tensor):
        """``(self(x), x)``, the residual's gradient added inside the fused backward."""
        return rms_norm_with_residual(x, self.weight, self.eps, self.zero_centered_gamma, use_fused=self.use_fused)


def build_norm(config: TransformerConfig, size: Optional[int] = None, grads_partial_over_tp: bool = False) -> Norm:
    """The model's normalization (``config.normalization``) over ``size`` features (default the hidden size)."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(config, size, grads_partial_over_tp)
