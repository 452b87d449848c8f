"""The pre-norm transformer layer and its normalization modules, LayerNorm and RMSNorm (the MLP is in ``mlp.py``,
the attention in ``attention.py``)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from megatron.core import tensor_parallel
from megatron.core.fusions import bias_dropout_add
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norm import LayerNorm, Norm, build_norm

__all__ = ["LayerNorm", "Norm", "TransformerLayer", "build_norm"]

class TransformerLayer(nn.Module):
    """x + Dropout(Attn(LN(x))) then x + Dropout(MLP(LN(x))), activations ``[s(/tp), b, h]``."""

    def __init__(self, config: TransformerConfig, pstate: ParallelState):
        super().__init__()
        self.config = config
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, pstate)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config, pstate)

    def _dropout_rng(self):
        # Under SP each TP rank holds a different slice of the sequence, so the residual dropout must draw
        # different masks per rank; without SP the activations are replicated and so must the masks be.
        if self.config.sequence_parallel and self.training and self.config.hidden_dropout > 0.0:
            return tensor_parallel.get_rng_tracker().fork()
        return contextlib.nullcontext()

    def _norm(self, layernorm: Norm, hidden: torch.Tensor):
        """(LayerNorm output, residual): the residual is the LayerNorm's input (pre-LN), or its output under
        ``apply_residual_connection_post_layernorm`` (the original BERT order)."""
        if self.config.apply_residual_connection_post_layernorm:
            normed = layernorm(hidden)
            return normed, normed
        return layernorm.with_residual(hidden)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rotary_pos_emb: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor:
        """``attention_mask``: optional bool key-padding mask ``[b, 1, 1, s]`` (True = masked out); only with
        ``config.attention_mask_type == "padding"``. ``rotary_pos_emb``: the rotary angles ``[s, 1, 1, r]``
        (``rope.RotaryEmbedding``) with ``position_embedding_type == "rope"``. ``kv_cache``: the layer's key/value
        cache while decoding incrementally (``SelfAttention.forward``)."""
        p, fused = self.config.hidden_dropout, self.config.use_fused_kernels and self.config.bias_dropout_fusion
        normed, residual = self._norm(self.input_layernorm, hidden)
        attn_out, attn_bias = self.self_attention(normed, attention_mask, rotary_pos_emb, kv_cache)
        with self._dropout_rng():
            hidden = bias_dropout_add(attn_out, attn_bias, residual, p, self.training, use_fused=fused)
        normed, residual = self._norm(self.pre_mlp_layernorm, hidden)
        mlp_out, mlp_bias = self.mlp(normed)
        with self._dropout_rng():
            hidden = bias_dropout_add(mlp_out, mlp_bias, residual, p, self.training, use_fused=fused)
        return hidden
