"""Key/value cache for incremental decoding: the inference context a forward of the model is given.

``GPTModel.forward(..., inference_context=cache)`` hands ``cache.layer(i)`` to the attention of the stage's layer
``i``; the attention computes its queries, keys and values as always (query-key norms, rotary embedding at the
tokens' absolute positions ``position_ids``) and, instead of attending over the forward's own tokens, calls
``attend(q, k, v)``: the new keys and values are written at ``cache.offset`` and the queries attend over everything
cached so far. A forward without a context is the plain full-recomputation path the cached one is tested against.
The caller passes the positions after the cached ones and advances ``offset`` once the forward is done.

The cache holds ``num_query_groups`` key/value heads (those of this tensor-parallel rank, ``num_query_groups / tp``)
of ``kv_channels`` channels each: under grouped-query attention each group's key and value serve its
``num_attention_heads / num_query_groups`` query heads.

All sequences of a batch share positions: prompts of different lengths are right-padded and decoding starts at
the shortest prompt's end, a longer prompt's own tokens replacing the sampled ones until it is consumed, so no
padding mask is ever needed.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class AttentionShape(NamedTuple):
    """What a stage's cache holds per layer: ``num_layers`` layers of ``groups`` key/value heads (this rank's) of
    ``head_dim`` channels."""

    num_layers: int
    groups: int
    head_dim: int


class KVCache:
    """Per-layer ``[b, g/tp, max_len, d]`` key and value buffers and the number of positions filled."""

    def __init__(self) -> None:
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        self.offset = 0
        # static decoding only: the position (long [1], on the device) a one-token forward writes, and the
        # positions it may attend to (bool [1, 1, 1, max_len], True up to and including that position)
        self.position: Optional[torch.Tensor] = None
        self.visible: Optional[torch.Tensor] = None

    def allocate(self, shape: AttentionShape, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        size = (batch, shape.groups, max_len, shape.head_dim)
        self.use([torch.empty(size, dtype=dtype, device=device) for _ in range(shape.num_layers)],
                 [torch.empty(size, dtype=dtype, device=device) for _ in range(shape.num_layers)])

    def use(self, keys: List[torch.Tensor], values: List[torch.Tensor]) -> None:
        """Decode into buffers the caller keeps (a static decoding step's, reused across calls)."""
        self.keys, self.values = list(keys), list(values)
        self.offset = 0

    def release(self) -> None:
        self.keys, self.values = [], []
        self.offset = 0
        self.position = self.visible = None

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def layer(self, index: int) -> "LayerKV":
        """The cache of the stage's layer ``index``, handed to its attention."""
        if index >= len(self.keys):
            raise ValueError(f"the KV cache holds {len(self.keys)} layers; layer {index} asked for it "
                             "(allocate it for this stage's layers first)")
        return LayerKV(self, index)


class LayerKV:
    """One layer's view of a ``KVCache``: ``attend`` stores the forward's keys and values and attends over the
    cached positions."""

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [s, b, n/tp, d]``, ``k, v [s, b, g/tp, d]`` at positions ``offset .. offset + s`` (or, in a static
        step, at the device position ``cache.position``) -> context ``[s, b, n/tp * d]``."""
        s, b, n, d = q.shape
        cache = self.cache
        k_buf, v_buf = cache.keys[self.index], cache.values[self.index]
        if k.shape[2] != k_buf.shape[1] or d != k_buf.shape[3]:
            raise ValueError(f"the KV cache holds {k_buf.shape[1]} key/value heads of {k_buf.shape[3]} channels per "
                             f"layer; the attention gives {k.shape[2]} of {d}")
        if cache.position is not None:  # one position whose index is on the device: the same kernels every step
            if s != 1 or b != k_buf.shape[0]:
                raise ValueError(f"the static decoding step takes one position of a batch of {k_buf.shape[0]}, "
                                 f"got {s} positions of {b}")
            k_buf.index_copy_(2, cache.position, k.permute(1, 2, 0, 3))  # [b, g, 1, d] into [b, g, T, d]
            v_buf.index_copy_(2, cache.position, v.permute(1, 2, 0, 3))
            keys, values, mask = k_buf, v_buf, cache.visible  # later positions are masked out
        else:
            start, end = cache.offset, cache.offset + s
            if end > cache.capacity:
                raise ValueError(f"KV cache holds {cache.capacity} positions, forward needs {end}")
            k_buf[:b, :, start:end] = k.permute(1, 2, 0, 3)  # [b, g, s, d]
            v_buf[:b, :, start:end] = v.permute(1, 2, 0, 3)
            keys, values = k_buf[:b, :, :end], v_buf[:b, :, :end]  # [b, g, end, d]
            # query i sits at absolute position start + i and sees keys 0 .. start + i
            mask = None
            if s > 1:
                mask = torch.ones(s, end, dtype=torch.bool, device=q.device).tril_(diagonal=start)  # [s, end]
        ctx = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), keys, values, attn_mask=mask,
                                             scale=1.0 / math.sqrt(d), enable_gqa=n != keys.shape[1])  # [b, n, s, d]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, n*d]


def attention_shape(model: nn.Module) -> AttentionShape:
    """The cache shape of ``model``'s layers (this rank's stage)."""
    if len(model.decoder.layers) == 0:
        return AttentionShape(0, 1, 1)
    attn = model.decoder.layers[0].self_attention
    return AttentionShape(len(model.decoder.layers), attn.groups_per_rank, attn.head_dim)


def cache_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def cache_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
