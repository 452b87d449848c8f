"""Parameter mapping between Hugging Face BERT checkpoints and our (Megatron-Core-named) BERT.

Two Hugging Face layouts map onto one model:
- ``MegatronBertForPreTraining`` (pre-LN): ``attention.ln`` / ``ln`` are each layer's ``input_layernorm`` /
  ``pre_mlp_layernorm`` and ``bert.encoder.ln`` is ``encoder.final_layernorm``; the model runs with
  ``apply_residual_connection_post_layernorm=False``.
- ``BertForPreTraining`` (post-LN): the embedding LayerNorm is layer 0's ``input_layernorm``, layer i's
  ``attention.output.LayerNorm`` its ``pre_mlp_layernorm``, and layer i's ``output.LayerNorm`` is layer i+1's
  ``input_layernorm`` (the last one is ``encoder.final_layernorm``); the model runs with
  ``apply_residual_connection_post_layernorm=True``.

Both convert to full (unsharded) state dicts; Hugging Face's separate query/key/value become the fused
``linear_qkv`` with per-head ``[q k v]`` rows, and the vocabulary is zero-padded to ``padded_vocab_size``.
A model without the binary head (no pooler, sentence-relationship head or token-type embedding) maps to the
masked-LM classes (``BertForMaskedLM`` / ``MegatronBertForMaskedLM``) with one zero token-type row.
``encoder_to_hf_bert`` maps the encoder alone (embeddings, layers, pooler): what a fine-tuned model exports under
its classifier (``hf_bert.save_hf_bert_finetuned``). Whole
checkpoint folders (config, tokenizer, any TP/PP) are ``megatron/core/checkpoint_formats/hf_bert.py``.
"""

from __future__ import annotations

from typing import Dict

import torch

_EMB = "bert.embeddings."
_PRED = "cls.predictions."


def is_post_ln_checkpoint(hf_state: Dict[str, torch.Tensor]) -> bool:
    """True for a ``BertForPreTraining`` state dict (embedding LayerNorm), False for ``MegatronBertForPreTraining``."""
    if _EMB + "LayerNorm.weight" in hf_state:
        return True
    if "bert.encoder.ln.weight" in hf_state:
        return False
    raise ValueError("not a Hugging Face BERT pre-training state dict: it has neither bert.embeddings.LayerNorm "
                     "(BertForPreTraining) nor bert.encoder.ln (MegatronBertForPreTraining)")


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Separate ``[h(, h_in)]`` q/k/v -> fused ``[3h(, h_in)]`` with per-head ``[q k v]`` rows."""
    d = q.shape[0] // num_heads
    stacked = torch.stack([t.reshape(num_heads, d, *t.shape[1:]) for t in (q, k, v)], dim=1)  # [n, 3, d(, h_in)]
    return stacked.reshape(3 * q.shape[0], *q.shape[1:])  # [3h(, h_in)]


def _split_qkv(qkv: torch.Tensor, num_heads: int):
    """Inverse of ``_fuse_qkv``: fused ``[3h(, h_in)]`` -> (q, k, v) each ``[h(, h_in)]``."""
    h = qkv.shape[0] // 3
    per_head = qkv.reshape(num_heads, 3, h // num_heads, *qkv.shape[1:])  # [n, 3, d(, h_in)]
    return tuple(per_head[:, j].reshape(h, *qkv.shape[1:]) for j in range(3))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < t.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the checkpoint's vocabulary {t.shape[0]}")
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _layernorm_pairs(num_layers: int, post_ln: bool):
    """(ours, Hugging Face's) prefixes of every LayerNorm."""
    layer = "bert.encoder.layer."
    if not post_ln:
        pairs = [(f"encoder.layers.{i}.input_layernorm", f"{layer}{i}.attention.ln") for i in range(num_layers)]
        pairs += [(f"encoder.layers.{i}.pre_mlp_layernorm", f"{layer}{i}.ln") for i in range(num_layers)]
        return pairs + [("encoder.final_layernorm", "bert.encoder.ln")]
    pairs = [("encoder.layers.0.input_layernorm", _EMB + "LayerNorm")]
    pairs += [(f"encoder.layers.{i}.pre_mlp_layernorm", f"{layer}{i}.attention.output.LayerNorm")
              for i in range(num_layers)]
    pairs += [(f"encoder.layers.{i + 1}.input_layernorm", f"{layer}{i}.output.LayerNorm")
              for i in range(num_layers - 1)]
    return pairs + [("encoder.final_layernorm", f"{layer}{num_layers - 1}.output.LayerNorm")]


def _layer_linear_pairs(num_layers: int):
    """(ours, Hugging Face's) prefixes of every layer's linears except the fused QKV."""
    layer = "bert.encoder.layer."
    pairs = []
    for i in range(num_layers):
        ours = f"encoder.layers.{i}."
        pairs += [(ours + "self_attention.linear_proj", f"{layer}{i}.attention.output.dense"),
                  (ours + "mlp.linear_fc1", f"{layer}{i}.intermediate.dense"),
                  (ours + "mlp.linear_fc2", f"{layer}{i}.output.dense")]
    return pairs


_POOLER = ("pooler.dense", "bert.pooler.dense")


def _linear_pairs(num_layers: int, binary_head: bool = True):
    """(ours, Hugging Face's) prefixes of every linear except the fused QKV."""
    pairs = _layer_linear_pairs(num_layers)
    pairs += [("lm_head.dense", _PRED + "transform.dense"), ("lm_head.layer_norm", _PRED + "transform.LayerNorm")]
    if binary_head:
        pairs += [_POOLER, ("binary_head", "cls.seq_relationship")]
    return pairs


def has_binary_head(hf_state: Dict[str, torch.Tensor]) -> bool:
    """True for a pre-training state dict (pooler and sentence-relationship head), False for a masked-LM one."""
    return "cls.seq_relationship.weight" in hf_state


def hf_to_megatron_bert(hf_state: Dict[str, torch.Tensor], num_layers: int, num_heads: int,
                        padded_vocab_size: int, tied: bool = True) -> Dict[str, torch.Tensor]:
    """A Hugging Face BERT pre-training (or masked-LM) state dict -> our full state dict (Megatron-Core names).

    The layout (pre- or post-LN) is read from the keys (``is_post_ln_checkpoint``); the model that loads the
    result must use the matching ``apply_residual_connection_post_layernorm``. With ``tied`` the decoder weight is
    the word embedding and no ``output_layer.weight`` is produced. A masked-LM state dict (no pooler and
    sentence-relationship head, ``has_binary_head``) gives a model without the binary head and without token-type
    embeddings, which needs Hugging Face's token-type embedding to be zero (as ``megatron_to_hf_bert`` writes it).
    """
    post_ln = is_post_ln_checkpoint(hf_state)
    binary = has_binary_head(hf_state)
    out = {
        "embedding.word_embeddings.weight": _pad_rows(hf_state[_EMB + "word_embeddings.weight"], padded_vocab_size),
        "embedding.position_embeddings.weight": hf_state[_EMB + "position_embeddings.weight"],
        "output_layer.bias": _pad_rows(hf_state[_PRED + "bias"], padded_vocab_size),
    }
    types = hf_state[_EMB + "token_type_embeddings.weight"]
    if binary:
        out["embedding.tokentype_embeddings.weight"] = types
    elif bool(types.any()):
        raise ValueError("a masked-LM BERT (no sentence-relationship head) with non-zero token-type embeddings has "
                         "no equivalent here: token types exist only with the binary head")
    if not tied:
        out["output_layer.weight"] = _pad_rows(hf_state[_PRED + "decoder.weight"], padded_vocab_size)
    for ours, theirs in _layernorm_pairs(num_layers, post_ln) + _linear_pairs(num_layers, binary):
        for leaf in ("weight", "bias"):
            out[f"{ours}.{leaf}"] = hf_state[f"{theirs}.{leaf}"]
    for i in range(num_layers):
        attn = f"bert.encoder.layer.{i}.attention.self."
        for leaf in ("weight", "bias"):
            q, k, v = (hf_state[f"{attn}{m}.{leaf}"] for m in ("query", "key", "value"))
            out[f"encoder.layers.{i}.self_attention.linear_qkv.{leaf}"] = _fuse_qkv(q, k, v, num_heads)
    return out


def megatron_to_hf_bert(state: Dict[str, torch.Tensor], num_layers: int, num_heads: int, vocab_size: int,
                        post_ln: bool) -> Dict[str, torch.Tensor]:
    """Our full state dict -> a Hugging Face ``BertForPreTraining`` (``post_ln``) or ``MegatronBertForPreTraining``
    state dict, the vocabulary cut back to ``vocab_size``. A model without the binary head gives a masked-LM state
    dict (``BertForMaskedLM`` / ``MegatronBertForMaskedLM``: no pooler) with one zero token-type row, so Hugging
    Face's always-present token-type embedding adds nothing."""
    binary = "binary_head.weight" in state
    if binary != ("embedding.tokentype_embeddings.weight" in state):
        raise ValueError("the binary head and the token-type embedding come together (2 token types with the "
                         "binary head, none without it)")
    out = encoder_to_hf_bert(state, num_layers, num_heads, vocab_size, post_ln)
    out[_PRED + "bias"] = state["output_layer.bias"][:vocab_size]
    out[_PRED + "decoder.weight"] = state.get("output_layer.weight", state["embedding.word_embeddings.weight"])[
        :vocab_size]
    out[_PRED + "decoder.bias"] = out[_PRED + "bias"]
    pairs = [("lm_head.dense", _PRED + "transform.dense"), ("lm_head.layer_norm", _PRED + "transform.LayerNorm")]
    for ours, theirs in pairs + ([("binary_head", "cls.seq_relationship")] if binary else []):
        for leaf in ("weight", "bias"):
            out[f"{theirs}.{leaf}"] = state[f"{ours}.{leaf}"]
    return out


def encoder_to_hf_bert(state: Dict[str, torch.Tensor], num_layers: int, num_heads: int, vocab_size: int,
                       post_ln: bool) -> Dict[str, torch.Tensor]:
    """The ``bert.*`` tensors of our full state dict: embeddings (one zero token-type row when the model has no
    token types), the layers, and the pooler when the model has one."""
    word = state["embedding.word_embeddings.weight"][:vocab_size]
    types = state.get("embedding.tokentype_embeddings.weight")
    if types is None:
        types = word.new_zeros((1, word.shape[1]))  # [1, h]: HF adds token type 0 to every token
    out = {
        _EMB + "word_embeddings.weight": word,
        _EMB + "position_embeddings.weight": state["embedding.position_embeddings.weight"],
        _EMB + "token_type_embeddings.weight": types,
    }
    pairs = _layernorm_pairs(num_layers, post_ln) + _layer_linear_pairs(num_layers)
    if "pooler.dense.weight" in state:
        pairs.append(_POOLER)
    for ours, theirs in pairs:
        for leaf in ("weight", "bias"):
            out[f"{theirs}.{leaf}"] = state[f"{ours}.{leaf}"]
    for i in range(num_layers):
        attn = f"bert.encoder.layer.{i}.attention.self."
        for leaf in ("weight", "bias"):
            q, k, v = _split_qkv(state[f"encoder.layers.{i}.self_attention.linear_qkv.{leaf}"], num_heads)
            out[f"{attn}query.{leaf}"], out[f"{attn}key.{leaf}"], out[f"{attn}value.{leaf}"] = q, k, v
    return out
