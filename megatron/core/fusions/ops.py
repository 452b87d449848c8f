"""Public element-wise ops used by the transformer layers, with their PyTorch references."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def bias_gelu_reference(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu(x + bias) with the exact (erf) GeLU."""
    if bias is not None:
        x = x + bias
    return F.gelu(x)


def bias_dropout_add_reference(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float, training: bool
) -> torch.Tensor:
    """residual + dropout(x + bias)."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """LayerNorm over the last dimension; with zero-centred gamma the stored weight is gamma - 1."""
    w = weight + 1 if zero_centered_gamma else weight
    return F.layer_norm(x, (x.shape[-1],), w, bias, eps)


def bias_gelu(x, bias, use_fused: bool = True):
    return bias_gelu_reference(x, bias)


def bias_dropout_add(x, bias, residual, prob, training, use_fused: bool = True):
    return bias_dropout_add_reference(x, bias, residual, prob, training)


def layer_norm(x, weight, bias, eps, zero_centered_gamma=False, use_fused: bool = True):
    return layer_norm_reference(x, weight, bias, eps, zero_centered_gamma)
