"""Hugging Face Llama-family weights (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``) <-> our
full GPT state dict with the Llama options (the weights only: the configuration's mapping is a separate concern).

``spec`` is the model's description: any object with the attributes ``num_layers``, ``num_attention_heads``,
``num_query_groups``, ``kv_channels``, ``gated_linear_unit``, ``normalization``, ``add_bias_linear``,
``add_qkv_bias``, ``qk_layernorm``, ``share_embeddings_and_output_weights``, ``rotary_interleaved`` and
``rotary_percent`` (``TransformerConfig`` has them all).

=============================================  ==========================================================
ours (``decoder.layers.N.`` below)             Hugging Face (``model.layers.N.`` below)
=============================================  ==========================================================
``embedding.word_embeddings.weight``           ``model.embed_tokens.weight`` (vocabulary padding removed)
``input_layernorm.weight``                     ``input_layernorm.weight``
``self_attention.linear_qkv.{weight,bias}``    ``self_attn.{q,k,v}_proj.{weight,bias}``: per query group our
                                               rows are its query heads, then its key head, then its value
                                               head; Hugging Face keeps all queries, all keys, all values
``self_attention.linear_proj.weight``          ``self_attn.o_proj.weight``
``pre_mlp_layernorm.weight``                   ``post_attention_layernorm.weight``
``mlp.linear_fc1.weight``                      ``mlp.gate_proj.weight`` then ``mlp.up_proj.weight`` (rows)
``mlp.linear_fc2.weight``                      ``mlp.down_proj.weight``
``decoder.final_layernorm.weight``             ``model.norm.weight``
``output_layer.weight`` (untied only)          ``lm_head.weight`` (tied: ``tie_word_embeddings``)
=============================================  ==========================================================

Rotary layout: Hugging Face rotates channel pairs ``(i, i + d/2)`` of each head, as our default
(``rotary_interleaved=False``) does, so the query and key rows map unchanged; an interleaved model's rows
``(2i, 2i + 1)`` are permuted to ``(i, i + d/2)`` on the way out and back on the way in. The full state dict is in
the model's (unsharded) layout; ``reshard.split_tp_pp`` splits it for any tensor-parallel size.
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron.core.checkpoint_formats.reshard import resize_vocab_rows
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError

_PLAIN = [  # (ours, Hugging Face), layer-relative
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
]


def check_llama_spec(spec, where: str) -> None:
    """Raise naming the first option a Hugging Face Llama-family model cannot hold."""
    problems = [
        (spec.normalization != "RMSNorm", "--normalization RMSNorm"),
        (not spec.gated_linear_unit, "--swiglu"),
        (spec.add_bias_linear, "--disable-bias-linear"),
        (spec.qk_layernorm, "no --qk-layernorm"),
        (spec.rotary_interleaved and spec.rotary_percent != 1.0, "--rotary-percent 1.0 with --rotary-interleaved"),
    ]
    for bad, need in problems:
        if bad:
            raise CheckpointFormatError(f"{where}: a Hugging Face Llama-family model needs {need}")


def _half_from_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head, rows ``(2i, 2i + 1)`` -> rows ``(i, i + d/2)``."""
    rest = tuple(w.shape[1:])
    d = w.shape[0] // heads
    return w.reshape((heads, d // 2, 2) + rest).transpose(1, 2).reshape(w.shape)


def _interleaved_from_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    rest = tuple(w.shape[1:])
    d = w.shape[0] // heads
    return w.reshape((heads, 2, d // 2) + rest).transpose(1, 2).reshape(w.shape)


def split_qkv(qkv: torch.Tensor, spec):
    """Our grouped ``linear_qkv`` rows (weight or bias) -> ``(q [n*d, ...], k [g*d, ...], v [g*d, ...])``."""
    n, g, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    rest = tuple(qkv.shape[1:])
    q, k, v = qkv.reshape((g, (n // g + 2) * d) + rest).split([n // g * d, d, d], dim=1)
    return q.reshape((n * d,) + rest), k.reshape((g * d,) + rest), v.reshape((g * d,) + rest)


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec) -> torch.Tensor:
    """The inverse of :func:`split_qkv`."""
    n, g, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    rest = tuple(q.shape[1:])
    parts = (q.reshape((g, n // g * d) + rest), k.reshape((g, d) + rest), v.reshape((g, d) + rest))
    return torch.cat(parts, dim=1).reshape(((n + 2 * g) * d,) + rest)


def to_hf_llama(full: Dict[str, torch.Tensor], spec, vocab_size: int) -> Dict[str, torch.Tensor]:
    """Our full state dict -> a ``LlamaForCausalLM`` (or Mistral/Qwen2) state dict; ``vocab_size``: the real
    vocabulary (the padding rows are dropped). ``lm_head.weight`` is present only for an untied model."""
    check_llama_spec(spec, "Hugging Face export")
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:vocab_size],
           "model.norm.weight": full["decoder.final_layernorm.weight"]}
    if not spec.share_embeddings_and_output_weights:
        out["lm_head.weight"] = full["output_layer.weight"][:vocab_size]
    n, g = spec.num_attention_heads, spec.num_query_groups
    for i in range(spec.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, hf in _PLAIN:
            out[dst + hf] = full[src + ours]
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        for leaf in ("weight", "bias") if spec.add_qkv_bias else ("weight",):
            q, k, v = split_qkv(full[src + "self_attention.linear_qkv." + leaf], spec)
            if spec.rotary_interleaved:
                q, k = _half_from_interleaved(q, n), _half_from_interleaved(k, g)
            out[dst + f"self_attn.q_proj.{leaf}"] = q
            out[dst + f"self_attn.k_proj.{leaf}"] = k
            out[dst + f"self_attn.v_proj.{leaf}"] = v
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_llama(hf_sd: Dict[str, torch.Tensor], spec, padded_vocab_size: int) -> Dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` (or Mistral/Qwen2) state dict -> our full state dict, the vocabulary rows padded
    (zeros) to ``padded_vocab_size``. A tied model's ``lm_head.weight`` (a copy of the embedding) is ignored."""
    check_llama_spec(spec, "Hugging Face import")

    def take(key: str) -> torch.Tensor:
        if key not in hf_sd:
            raise CheckpointFormatError(f"Hugging Face weights lack {key}")
        return hf_sd[key]

    full = {"embedding.word_embeddings.weight": resize_vocab_rows(take("model.embed_tokens.weight"),
                                                                  padded_vocab_size)}
    n, g = spec.num_attention_heads, spec.num_query_groups
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        full[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        for leaf in ("weight", "bias") if spec.add_qkv_bias else ("weight",):
            q, k, v = (take(src + f"self_attn.{x}_proj.{leaf}") for x in "qkv")
            if spec.rotary_interleaved:
                q, k = _interleaved_from_half(q, n), _interleaved_from_half(k, g)
            full[dst + "self_attention.linear_qkv." + leaf] = join_qkv(q, k, v, spec)
        full[dst + "self_attention.linear_proj.weight"] = take(src + "self_attn.o_proj.weight")
        full[dst + "pre_mlp_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        full[dst + "mlp.linear_fc1.weight"] = torch.cat([take(src + "mlp.gate_proj.weight"),
                                                         take(src + "mlp.up_proj.weight")], dim=0)
        full[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
    full["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if not spec.share_embeddings_and_output_weights:
        full["output_layer.weight"] = resize_vocab_rows(take("lm_head.weight"), padded_vocab_size)
    return {k: v.contiguous() for k, v in full.items()}
