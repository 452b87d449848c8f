"""Key/value cache for incremental decoding, installed in place of each layer's attention core.

``install_kv_cache(model)`` swaps every ``SelfAttention.core_attention`` for a ``CachedCoreAttention`` that
shares one ``KVCache``. While the cache is inactive the wrapper calls the original attention core, so the model
behaves exactly as before (the full-recomputation path the cached path is tested against). While it is active,
each forward appends the new keys and values at ``cache.offset`` and attends over everything cached so far; the
caller passes the matching ``position_ids`` to the model and advances the offset once the forward is done.

All sequences of a batch share positions: prompts of different lengths are right-padded and decoding starts at
the shortest prompt's end, a longer prompt's own tokens replacing the sampled ones until it is consumed, so no
padding mask is ever needed.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.transformer.attention import CoreAttention


class KVCache:
    """Per-layer ``[b, n/tp, max_len, d]`` key and value buffers and the number of positions filled."""

    def __init__(self) -> None:
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        self.offset = 0
        self.active = False
        # static decoding only: the position (long [1], on the device) a one-token forward writes, and the
        # positions it may attend to (bool [1, 1, 1, max_len], True up to and including that position)
        self.position: Optional[torch.Tensor] = None
        self.visible: Optional[torch.Tensor] = None

    def allocate(self, num_layers: int, batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, heads, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.offset = 0
        self.active = True

    def use(self, keys: List[torch.Tensor], values: List[torch.Tensor]) -> None:
        """Activate the cache on buffers the caller keeps (a static decoding step's, reused across calls)."""
        self.keys, self.values = list(keys), list(values)
        self.offset = 0
        self.active = True

    def release(self) -> None:
        self.keys, self.values = [], []
        self.offset = 0
        self.active = False
        self.position = self.visible = None

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


class CachedCoreAttention(nn.Module):
    """Attention core of one layer that reads and extends the shared cache while it is active."""

    def __init__(self, original: CoreAttention, cache: KVCache, layer_index: int):
        super().__init__()
        self.original = original
        self.cache, self.layer_index = cache, layer_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.cache.active:
            return self.original(q, k, v, attention_mask)
        if attention_mask is not None:  # the cache serves causal decoders, whose attention takes no padding mask
            raise ValueError("KV-cached generation runs causal models only; a padding mask was given")
        if self.cache.position is not None:
            return self._static_step(q, k, v)
        s, b, n, d = q.shape  # q, k, v: [s, b, n/tp, d]
        start, end = self.cache.offset, self.cache.offset + s
        if end > self.cache.capacity:
            raise ValueError(f"KV cache holds {self.cache.capacity} positions, forward needs {end}")
        k_buf, v_buf = self.cache.keys[self.layer_index], self.cache.values[self.layer_index]
        k_buf[:b, :, start:end] = k.permute(1, 2, 0, 3)  # [b, n, s, d]
        v_buf[:b, :, start:end] = v.permute(1, 2, 0, 3)  # [b, n, s, d]
        q = q.permute(1, 2, 0, 3)  # [b, n, s, d]
        keys, values = k_buf[:b, :, :end], v_buf[:b, :, :end]  # [b, n, end, d]
        # query i sits at absolute position start + i and sees keys 0 .. start + i
        mask = None
        if s > 1:
            mask = torch.ones(s, end, dtype=torch.bool, device=q.device).tril_(diagonal=start)  # [s, end]
        ctx = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(d))
        return ctx.permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, n*d]

    def _static_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One position whose index is on the device: the same kernels and shapes at every position."""
        s, b, n, d = q.shape  # q, k, v: [1, b, n/tp, d]
        k_buf, v_buf = self.cache.keys[self.layer_index], self.cache.values[self.layer_index]
        if s != 1 or b != k_buf.shape[0]:
            raise ValueError(f"the static decoding step takes one position of a batch of {k_buf.shape[0]}, "
                             f"got {s} positions of {b}")
        k_buf.index_copy_(2, self.cache.position, k.permute(1, 2, 0, 3))  # [b, n, 1, d] into [b, n, T, d]
        v_buf.index_copy_(2, self.cache.position, v.permute(1, 2, 0, 3))  # [b, n, 1, d] into [b, n, T, d]
        q = q.permute(1, 2, 0, 3)  # [b, n, 1, d]
        # every buffered position is attended to; those after the current one are masked out
        ctx = F.scaled_dot_product_attention(q, k_buf, v_buf, attn_mask=self.cache.visible,
                                             scale=1.0 / math.sqrt(d))  # [b, n, 1, d]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, n * d)  # [1, b, n*d]


def install_kv_cache(model: nn.Module) -> KVCache:
    """Give every transformer layer of ``model`` a cached attention core sharing one ``KVCache``; a model that
    already has them keeps them and returns their cache (engines over one model share it)."""
    layers = model.decoder.layers
    cores = [layer.self_attention.core_attention for layer in layers]
    if cores and all(isinstance(c, CachedCoreAttention) for c in cores):
        return cores[0].cache
    cache = KVCache()
    for i, layer in enumerate(layers):
        layer.self_attention.core_attention = CachedCoreAttention(cores[i], cache, i)
    return cache


def attention_shape(model: nn.Module) -> tuple:
    """``(num_layers, heads on this rank, head_dim)`` of the model's layers."""
    if len(model.decoder.layers) == 0:
        return 0, 1, 1
    attn = model.decoder.layers[0].self_attention
    return len(model.decoder.layers), attn.heads_per_rank, attn.head_dim


def cache_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def cache_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def reset_cache(cache: Optional[KVCache]) -> None:
    if cache is not None:
        cache.release()
