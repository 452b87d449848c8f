"""Our GPT's weights in a Hugging Face ``GPT2LMHeadModel``, the independent reference that the inference tests and
``bench/generation.py`` compare against. The tensor mapping is the converter's
(``megatron/core/checkpoint_formats/hf_gpt2.py``); ``transformers`` is imported only when this is called."""

from __future__ import annotations

import torch

from megatron.core.checkpoint_formats.hf_gpt2 import build_hf_gpt2
from megatron.core.checkpoint_formats.common import dims_from_spec


def to_hf_gpt2(model, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    """A ``transformers.GPT2LMHeadModel`` holding the weights of ``model`` (a whole GPT at TP=1), on the same
    device, in ``dtype``. Every embedding row is kept (the vocabulary padding too), so the logits have the
    model's padded width; dropout is off."""
    cfg = model.config
    tied = cfg.share_embeddings_and_output_weights
    dims = dims_from_spec(cfg.spec, vocab_size=cfg.padded_vocab_size)
    full = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state") and torch.is_tensor(v)}
    if tied:
        full.pop("output_layer.weight", None)
    return build_hf_gpt2(full, dims, dtype=dtype, attn_implementation=attn_implementation)
