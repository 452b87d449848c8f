"""Self-attention with heads split across tensor-parallel ranks.

QKV is one column-parallel GEMM whose output rows are laid out per head as ``[q k v]`` (Megatron-Core's
``linear_qkv`` layout), so a contiguous split over TP ranks gives each rank whole heads. The output projection
is row-parallel: its reduction (``g``) is the only communication in the forward pass.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import tensor_parallel
from megatron.core.fusions import scaled_masked_softmax
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig


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
        # q, k, v: [s, b, n, d] -> context [s, b, n*d]; attention_mask: bool [b, 1, 1, s] (True = padding), only
        # with config.attention_mask_type == "padding"
        s, b, n, d = q.shape
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
        self.head_dim = config.kv_channels
        h = config.hidden_size
        self.linear_qkv = tensor_parallel.ColumnParallelLinear(
            h, 3 * h, config=config, pstate=pstate, bias=True, gather_output=False
        )
        self.core_attention = CoreAttention(config)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            h, h, config=config, pstate=pstate, bias=True, input_is_parallel=True, skip_bias_add=True
        )
        self.recompute_core = config.recomputes("core_attn")

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """hidden ``[s(/tp under SP), b, h]`` -> (output ``[s(/tp), b, h]``, projection bias).

        ``attention_mask``: optional bool key-padding mask ``[b, 1, 1, s]`` (True = masked out), padding type only.
        """
        qkv, _ = self.linear_qkv(hidden)  # [s, b, 3h/tp]
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.heads_per_rank, 3 * self.head_dim)  # per-head [q k v]
        q, k, v = qkv.split(self.head_dim, dim=-1)  # each [s, b, n/tp, d]
        if self.recompute_core and self.training:
            ctx = tensor_parallel.checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)  # [s, b, h/tp]
        return self.linear_proj(ctx)
