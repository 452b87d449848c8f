"""Self-attention with heads split across tensor-parallel ranks, grouped-query attention included.

``num_query_groups`` key/value heads serve ``num_attention_heads`` query heads (each group ``n / g`` query heads;
multi-query attention is ``g = 1``, classic multi-head attention ``g = n``). QKV is one column-parallel GEMM whose
output rows are laid out per query group as ``[q_1 .. q_{n/g} k v]``, ``kv_channels`` rows each (Megatron-Core's
``linear_qkv`` layout; with ``g = n`` the per-head ``[q k v]``), so a contiguous split over TP ranks gives each rank
whole groups (``tensor_parallel.sharding.qkv_sharding``; ``g`` must be divisible by TP). The output
projection is row-parallel: its reduction (``g``) is the only communication in the forward pass.

With ``qk_layernorm`` each head's queries and keys are normalized over the head dimension (``q_layernorm``,
``k_layernorm``); with rotary position embedding (``rope.py``) they are then rotated.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import tensor_parallel
from megatron.core.fusions import apply_rotary_pos_emb, scaled_masked_softmax
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.sharding import qkv_sharding
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.norm import build_norm


def unfused_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, padding_mask: torch.Tensor | None = None,
    use_fused_softmax: bool = True, causal: bool = True,
) -> torch.Tensor:
    """Explicit scale -> upper-triangular causal mask (+ optional padding mask) -> softmax (fp32) -> dropout -> xV.

    q, k, v: ``[b, n, s, d]``; ``padding_mask``: bool ``[b, 1, 1, s]`` (True = masked out). Returns ``[b, n, s, d]``.
    The fused softmax keeps only 16-bit probabilities for backward (the paper's ``5as/h`` bytes).
    ``causal=False`` drops the causal mask (bidirectional attention, the padding mask alone).
    """
    s_q, s_k = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2))  # [b, n, s, s]
    if causal:
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu_(1)
        mask = mask if padding_mask is None else (mask | padding_mask)
    else:
        mask = padding_mask
    probs = scaled_masked_softmax(scores, mask, 1.0 / math.sqrt(q.shape[-1]), use_fused=use_fused_softmax)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v)


_SDPA_ONLY = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V with a causal mask, or bidirectional with an optional key-padding mask
    (``config.attention_mask_type``); the part selective recomputation recomputes.

    Backends: ``sdpa`` lets PyTorch choose among its kernels; ``flash`` and ``cudnn`` restrict SDPA to that one
    kernel (an error, not a silent fallback, when it cannot run the inputs); ``unfused`` is the explicit path.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.only_kernel = _SDPA_ONLY.get(config.attention_backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # q: [s, b, n, d], k, v: [s, b, g, d] (g key/value heads, n % g == 0) -> context [s, b, n*d];
        # attention_mask: bool [b, 1, 1, s] (True = padding), only with config.attention_mask_type == "padding"
        s, b, n, d = q.shape
        if k.shape[2] != n:  # grouped-query attention: query head i reads key/value head i // (n / g)
            k, v = (t.repeat_interleave(n // t.shape[2], dim=2) for t in (k, v))  # [s, b, n, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        p = self.config.attention_dropout if self.training else 0.0
        causal = self.config.attention_mask_type == "causal"
        if causal and attention_mask is not None:
            raise ValueError("an attention mask needs attention_mask_type='padding' (causal attention takes none)")
        # SDPA's boolean mask marks the positions to attend to: the inverse of ours
        sdpa_mask = None if attention_mask is None else ~attention_mask
        # Heads are split over TP ranks, so attention dropout draws from the per-TP-rank generator; without
        # dropout there is nothing to draw, and skipping the fork keeps torch.compile graphs whole.
        rng = tensor_parallel.get_rng_tracker().fork() if p > 0.0 else contextlib.nullcontext()
        with rng:
            if self.only_kernel is not None:
                if not q.is_cuda:
                    raise ValueError(f"attention backend {self.config.attention_backend} needs CUDA tensors; "
                                     "use --attention-backend auto or unfused on this device")
                if sdpa_mask is not None and self.only_kernel == SDPBackend.FLASH_ATTENTION:
                    raise ValueError("attention backend flash takes no padding mask; use sdpa, cudnn or unfused")
                with sdpa_kernel(self.only_kernel):
                    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=p, is_causal=causal)
            elif self.config.attention_backend == "sdpa":
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=p, is_causal=causal)
            else:
                ctx = unfused_causal_attention(q, k, v, p, padding_mask=attention_mask,
                                               use_fused_softmax=self.config.use_fused_kernels, causal=causal)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, n*d]


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig, pstate: ParallelState):
        super().__init__()
        config.check_tensor_parallel(pstate.tp_size)
        self.config = config
        self.heads_per_rank = config.num_attention_heads // pstate.tp_size
        self.groups_per_rank = config.num_query_groups // pstate.tp_size
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.head_dim = d = config.kv_channels
        h = config.hidden_size
        group_rows = (self.heads_per_group + 2) * d  # one query group's [q_1 .. q_{n/g} k v] rows
        self.linear_qkv = tensor_parallel.ColumnParallelLinear(
            h, config.num_query_groups * group_rows, config=config, pstate=pstate,
            bias=config.add_bias_linear or config.add_qkv_bias, gather_output=False,
            output_sharding=qkv_sharding(config.num_attention_heads, config.num_query_groups, d),
        )
        if config.qk_layernorm:
            self.q_layernorm = build_norm(config, d, grads_partial_over_tp=pstate.tp_size > 1)
            self.k_layernorm = build_norm(config, d, grads_partial_over_tp=pstate.tp_size > 1)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.core_attention = CoreAttention(config)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            config.num_attention_heads * d, h, config=config, pstate=pstate, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True,
        )
        self.recompute_core = config.recomputes("core_attn")
        self.use_fused_rope = config.use_fused_kernels

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rotary_pos_emb: torch.Tensor | None = None, kv_cache=None):
        """hidden ``[s(/tp under SP), b, h]`` -> (output ``[s(/tp), b, h]``, projection bias or None).

        ``attention_mask``: optional bool key-padding mask ``[b, 1, 1, s]`` (True = masked out), padding type only.
        ``rotary_pos_emb``: rotary angles ``[s, 1, 1, r]`` applied to queries and keys, or None.
        ``kv_cache``: this layer's key/value cache during incremental decoding (``inference.kv_cache.LayerKV``):
        its ``attend(q, k, v)`` stores the new keys and values and attends over every cached position.
        """
        qkv, _ = self.linear_qkv(hidden)  # [s, b, (n + 2g)/tp * d]
        s, b, _ = qkv.shape
        d = self.head_dim
        qkv = qkv.view(s, b, self.groups_per_rank, (self.heads_per_group + 2) * d)  # per group [q.. k v]
        q, k, v = qkv.split([self.heads_per_group * d, d, d], dim=-1)
        q = q.reshape(s, b, self.heads_per_rank, d)  # [s, b, n/tp, d]; k, v: [s, b, g/tp, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb, self.config.rotary_interleaved, use_fused=self.use_fused_rope)
            k = apply_rotary_pos_emb(k, rotary_pos_emb, self.config.rotary_interleaved, use_fused=self.use_fused_rope)
        if kv_cache is not None:
            if attention_mask is not None:
                raise ValueError("KV-cached decoding runs causal models only; a padding mask was given")
            ctx = kv_cache.attend(q, k, v)  # [s, b, n/tp * d]
        elif self.recompute_core and self.training:
            ctx = tensor_parallel.checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)  # [s, b, n/tp * d]
        return self.linear_proj(ctx)
