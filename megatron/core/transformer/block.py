"""A stack of transformer layers (one pipeline stage's share) with full activation recomputation."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from megatron.core import tensor_parallel
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import Norm, TransformerLayer, build_norm


def layer_config(config: TransformerConfig, index: int) -> TransformerConfig:
    """The config of this stage's layer ``index``: ``config`` itself, except that a layer past the first
    ``recompute_num_layers`` under selective recomputation recomputes nothing."""
    if (config.recompute_granularity == "selective" and config.recompute_num_layers is not None
            and index >= config.recompute_num_layers):
        return dataclasses.replace(config, recompute_modules=())
    return config


class TransformerBlock(nn.Module):
    """``num_layers`` layers, plus the final norm when this is the last pipeline stage.

    Full recomputation (``config.recompute_granularity == "full"``):
    - ``uniform``: layers are grouped ``recompute_num_layers`` at a time and each group's input is the only
      activation kept; the group is recomputed in backward.
    - ``block``: the first ``recompute_num_layers`` layers of this stage are recomputed one by one; the rest keep
      their activations (trade memory for time per stage).

    Selective recomputation with ``recompute_num_layers`` set applies to the first that many layers of the stage
    only (an extension: Megatron-LM applies selective recomputation to every layer): each layer is built from
    its own config (``layer_config``), so it decides its recomputation once, at construction.
    """

    def __init__(
        self, config: TransformerConfig, pstate: ParallelState, num_layers: int, post_layer_norm: bool,
        use_torch_compile: bool = False,
    ):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([TransformerLayer(layer_config(config, i), pstate) for i in range(num_layers)])
        self.final_layernorm: Optional[Norm] = build_norm(config) if post_layer_norm else None
        self._layer_fns = [torch.compile(layer) if use_torch_compile else layer for layer in self.layers]
        if config.recompute_granularity == "full":
            n = config.recompute_num_layers or 1
            if n < 1:
                raise ValueError(f"--recompute-num-layers must be >= 1, got {n}")

    def _run(self, start: int, end: int):
        def fn(hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
               rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
            for i in range(start, end):
                hidden = self._call_layer(i, hidden, attention_mask, rotary_pos_emb)
            return hidden

        return fn

    def _call_layer(self, i: int, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
        # the causal (GPT) call without rotary embedding keeps its one-argument form
        if rotary_pos_emb is not None:
            return self._layer_fns[i](hidden, attention_mask, rotary_pos_emb)
        if attention_mask is None:
            return self._layer_fns[i](hidden)
        return self._layer_fns[i](hidden, attention_mask)

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_context=None) -> torch.Tensor:
        """``attention_mask``: optional bool key-padding mask ``[b, 1, 1, s]`` (True = masked out), handed to every
        layer (``config.attention_mask_type == "padding"`` only); ``rotary_pos_emb``: the rotary angles
        ``[s, 1, 1, r]`` every layer applies to its queries and keys, or None; ``inference_context``: the
        key/value cache of incremental decoding (``inference.kv_cache.KVCache``), whose ``layer(i)`` is the cache
        of this stage's layer ``i``."""
        n_layers = len(self.layers)
        cfg = self.config
        if inference_context is not None:
            for i, layer in enumerate(self.layers):
                hidden = layer(hidden, attention_mask, rotary_pos_emb, inference_context.layer(i))
        elif cfg.recompute_granularity == "full" and self.training and n_layers > 0:
            n = cfg.recompute_num_layers or 1
            if cfg.recompute_method == "uniform":
                for start in range(0, n_layers, n):
                    hidden = tensor_parallel.checkpoint(self._run(start, min(start + n, n_layers)), hidden,
                                                        attention_mask, rotary_pos_emb)
            else:  # block
                for i in range(n_layers):
                    if i < n:
                        hidden = tensor_parallel.checkpoint(self._run(i, i + 1), hidden, attention_mask,
                                                            rotary_pos_emb)
                    else:
                        hidden = self._call_layer(i, hidden, attention_mask, rotary_pos_emb)
        else:
            hidden = self._run(0, n_layers)(hidden, attention_mask, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden
