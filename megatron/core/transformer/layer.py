"""The pre-LayerNorm transformer layer and its LayerNorm module (the MLP is in ``mlp.py``)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from megatron.core import tensor_parallel
from megatron.core.fusions import bias_dropout_add, layer_norm, layer_norm_with_residual
from megatron.core.parallel_state import ParallelState, default_device
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.mlp import MLP


class LayerNorm(nn.Module):
    """LayerNorm over the hidden dimension; under sequence parallelism its grads are summed across TP."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        h, dev, dt = config.hidden_size, default_device(), config.params_dtype
        self.weight = nn.Parameter(torch.empty(h, device=dev, dtype=dt))
        self.bias = nn.Parameter(torch.empty(h, device=dev, dtype=dt))
        for p in (self.weight, self.bias):
            p.sequence_parallel = config.sequence_parallel
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.use_fused = config.use_fused_kernels and config.layernorm_fusion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma, use_fused=self.use_fused)

    def with_residual(self, x: torch.Tensor):
        """``(self(x), x)``; use the second for the residual branch, so that its gradient is added inside the
        fused LayerNorm backward (``ops.layer_norm_with_residual``)."""
        return layer_norm_with_residual(x, self.weight, self.bias, self.eps, self.zero_centered_gamma,
                                        use_fused=self.use_fused)


class TransformerLayer(nn.Module):
    """x + Dropout(Attn(LN(x))) then x + Dropout(MLP(LN(x))), activations ``[s(/tp), b, h]``."""

    def __init__(self, config: TransformerConfig, pstate: ParallelState):
        super().__init__()
        self.config = config
        self.input_layernorm = LayerNorm(config)
        self.self_attention = SelfAttention(config, pstate)
        self.pre_mlp_layernorm = LayerNorm(config)
        self.mlp = MLP(config, pstate)

    def _dropout_rng(self):
        # Under SP each TP rank holds a different slice of the sequence, so the residual dropout must draw
        # different masks per rank; without SP the activations are replicated and so must the masks be.
        if self.config.sequence_parallel and self.training and self.config.hidden_dropout > 0.0:
            return tensor_parallel.get_rng_tracker().fork()
        return contextlib.nullcontext()

    def _norm(self, layernorm: LayerNorm, hidden: torch.Tensor):
        """(LayerNorm output, residual): the residual is the LayerNorm's input (pre-LN), or its output under
        ``apply_residual_connection_post_layernorm`` (the original BERT order)."""
        if self.config.apply_residual_connection_post_layernorm:
            normed = layernorm(hidden)
            return normed, normed
        return layernorm.with_residual(hidden)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask``: optional bool key-padding mask ``[b, 1, 1, s]`` (True = masked out); only with
        ``config.attention_mask_type == "padding"``."""
        p, fused = self.config.hidden_dropout, self.config.use_fused_kernels and self.config.bias_dropout_fusion
        normed, residual = self._norm(self.input_layernorm, hidden)
        attn_out, attn_bias = self.self_attention(normed, attention_mask)
        with self._dropout_rng():
            hidden = bias_dropout_add(attn_out, attn_bias, residual, p, self.training, use_fused=fused)
        normed, residual = self._norm(self.pre_mlp_layernorm, hidden)
        mlp_out, mlp_bias = self.mlp(normed)
        with self._dropout_rng():
            hidden = bias_dropout_add(mlp_out, mlp_bias, residual, p, self.training, use_fused=fused)
        return hidden
