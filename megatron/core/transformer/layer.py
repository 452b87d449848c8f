"""The pre-LayerNorm transformer layer, its MLP and its LayerNorm module."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from megatron.core import tensor_parallel
from megatron.core.fusions import bias_dropout_add, bias_gelu, bias_gelu_linear, layer_norm, layer_norm_with_residual
from megatron.core.parallel_state import ParallelState, default_device
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.config import TransformerConfig


class LayerNorm(nn.Module):
    """LayerNorm over the hidden dimension; under sequence parallelism its grads are summed across TP."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        h, dev, dt = config.hidden_size, default_device(), config.params_dtype
        self.weight = nn.Parameter(torch.empty(h, device=dev, dtype=dt))
        self.bias = nn.Parameter(torch.empty(h, device=dev, dtype=dt))
        for p in (self.weight, self.bias):
            p.sequence_parallel = config.sequence_parallel
            # the fused backward adds gamma/beta gradients straight into main_grad (fusions/main_grad.py)
            p.grad_accumulation_fusion = config.gradient_accumulation_fusion
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


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel); the GeLU needs no communication.

    Under ``--recompute-granularity selective`` (module ``mlp_act``) the GeLU output is not kept for backward but
    recomputed from the first GEMM's output (which the GeLU backward keeps anyway): with flash attention the
    attention core stores little, and the GeLU output is ``8sbh/t`` bytes per layer for one element-wise pass.
    """

    def __init__(self, config: TransformerConfig, pstate: ParallelState):
        super().__init__()
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, config=config, pstate=pstate, bias=True,
            gather_output=False, skip_bias_add=True,
        )
        self.linear_fc2 = tensor_parallel.RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, config=config, pstate=pstate, bias=True,
            input_is_parallel=True, skip_bias_add=True,
        )
        self.use_fused = config.use_fused_kernels and config.bias_gelu_fusion
        self.recompute_gelu = config.recomputes("mlp_act")
        self.grad_accum_fusion = config.gradient_accumulation_fusion
        self.fp8, self.fp8_margin = config.fp8, config.fp8_margin

    def forward(self, hidden: torch.Tensor):
        inter, inter_bias = self.linear_fc1(hidden)  # [s, b, ffn/tp]
        recompute = self.recompute_gelu and self.training
        if recompute or self.fp8 is not None:
            # under FP8 always: the GeLU is computed inside the quantization of FC2's input
            fc2 = self.linear_fc2
            partial = bias_gelu_linear(inter, inter_bias, fc2.weight, use_fused=self.use_fused,
                                       gradient_accumulation_fusion=self.grad_accum_fusion,
                                       fp8_format=self.fp8, fp8_margin=self.fp8_margin,
                                       recompute=recompute, fp8_sites=fc2.fp8_sites)  # [s, b, h] partial
            if fc2.sequence_parallel:
                out = tensor_parallel.reduce_scatter_to_sequence_parallel_region(partial, fc2.tp_group)  # [s/tp, b, h]
            else:
                out = tensor_parallel.reduce_from_tensor_model_parallel_region(partial, fc2.tp_group)  # [s, b, h]
            return out, fc2.bias
        inter = bias_gelu(inter, inter_bias, use_fused=self.use_fused)
        return self.linear_fc2(inter)  # ([s(/tp), b, h], bias)


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
