"""Hugging Face Llama-family configurations (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``) <-> ``ModelSpec``,
and the model folders ``tools/checkpoint/convert.py --loader hf`` reads and ``--saver hf`` writes.

The weights' mapping (grouped QKV, the fused gate/up, the rotary layout) is ``hf_llama_weights.py``; this module
maps the model description and reads/writes folders with it. Facts used:

=============================  ==========================================================================
``config.json``                ModelSpec
=============================  ==========================================================================
num_hidden_layers, hidden_size num_layers, hidden_size
num_attention_heads            num_attention_heads
num_key_value_heads            num_query_groups (default: one per head)
head_dim                       kv_channels (default hidden_size / heads)
intermediate_size              ffn_hidden_size; ``hidden_act`` silu: gated_linear_unit, activation silu (SwiGLU)
max_position_embeddings        max_position_embeddings (and seq_length)
vocab_size                     padded_vocab_size (the rows as stored)
rms_norm_eps                   layernorm_epsilon; normalization RMSNorm
rope_theta                     rotary_base; position_embedding_type rope (``rope_parameters`` in transformers 5)
rope_scaling llama3            use_rope_scaling, rope_scaling_factor: Megatron's ``--use-rope-scaling`` is Llama
                               3.1's rule with low_freq_factor 1, high_freq_factor 4 and an original context of
                               8192 positions, so only that one converts
rope_scaling linear            rotary_seq_len_interpolation_factor
partial_rotary_factor          rotary_percent
tie_word_embeddings            share_embeddings_and_output_weights (Llama's default: untied)
attention_bias, mlp_bias       add_bias_linear (Llama: both or neither, as Megatron's one switch)
Qwen2 (q, k, v biases only)    add_bias_linear False, add_qkv_bias True
Mistral sliding_window         refused unless it covers every position (no sliding-window attention here)
=============================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core.checkpoint_formats.common import dims_from_spec
from megatron.core.checkpoint_formats.hf_gpt2 import read_hf_weights
from megatron.core.checkpoint_formats.hf_llama_weights import from_hf_llama, to_hf_llama
from megatron.core.checkpoint_formats.layout import ModelDims, pad_vocab_size
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError
from megatron.core.model_spec import ModelSpec

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Megatron-LM's --use-rope-scaling: Llama 3.1's frequency scaling with these fixed parameters
LLAMA3_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(config: Dict[str, Any]):
    """``(theta, scaling dict or None)`` from either spelling: transformers 4 (``rope_theta``, ``rope_scaling``)
    or 5 (``rope_parameters`` holding both)."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def spec_from_hf_llama_config(config: Dict[str, Any], where: str = "config.json") -> ModelSpec:
    """The ``ModelSpec`` of a Llama, Mistral or Qwen2 ``config.json`` (a dict); one line naming the field for a
    configuration the spec cannot describe."""
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise CheckpointFormatError(f"{where}: model_type {kind!r} is not a Llama-family model "
                                    f"({', '.join(ARCHITECTURES)})")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointFormatError(f"{where}: hidden_act {act!r} is not supported (silu: the SwiGLU MLP)")
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    max_pos = int(config["max_position_embeddings"])
    theta, scaling = _rope(config)
    if theta != int(theta):
        raise CheckpointFormatError(f"{where}: rope_theta {theta} is not an integer (Megatron's --rotary-base is)")
    rope = {}
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type == "llama3":
            bad = [k for k, v in LLAMA3_ROPE_SCALING.items() if float(scaling.get(k, -1)) != v]
            if bad:
                raise CheckpointFormatError(f"{where}: rope_scaling {bad[0]} {scaling.get(bad[0])} differs from "
                                            f"--use-rope-scaling's {LLAMA3_ROPE_SCALING[bad[0]]:g}")
            rope = dict(use_rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
        elif rope_type == "linear":
            rope = dict(rotary_seq_len_interpolation_factor=float(scaling["factor"]))
        else:
            raise CheckpointFormatError(f"{where}: rope_scaling type {rope_type!r} is not supported (llama3 or "
                                        "linear)")
    window = config.get("sliding_window")
    if window is not None and config.get("use_sliding_window", kind == "mistral") and int(window) < max_pos:
        raise CheckpointFormatError(f"{where}: sliding_window {window} is not supported (attention here covers "
                                    "every position)")
    if kind == "qwen2":
        bias, qkv_bias = False, True
    else:
        attn_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            raise CheckpointFormatError(f"{where}: attention_bias {attn_bias} with mlp_bias {mlp_bias} is not "
                                        "supported (biases on every linear layer, or on none)")
        bias, qkv_bias = attn_bias, False
    try:
        return ModelSpec(
            num_layers=int(config["num_hidden_layers"]), hidden_size=h, num_attention_heads=heads,
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            kv_channels=int(config.get("head_dim") or h // heads),
            ffn_hidden_size=int(config["intermediate_size"]), seq_length=max_pos, max_position_embeddings=max_pos,
            padded_vocab_size=int(config["vocab_size"]), normalization="RMSNorm",
            layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)), position_embedding_type="rope",
            rotary_base=int(theta), rotary_percent=float(config.get("partial_rotary_factor", 1.0)), **rope,
            gated_linear_unit=True, activation="silu", add_bias_linear=bias, add_qkv_bias=qkv_bias,
            share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)))
    except (KeyError, ValueError) as exc:
        raise CheckpointFormatError(f"{where}: {exc}") from None


def llama_model_type(spec: ModelSpec) -> str:
    """The Hugging Face family that holds ``spec``: ``qwen2`` for QKV-only biases, else ``llama``."""
    return "qwen2" if spec.add_qkv_bias and not spec.add_bias_linear else "llama"


def hf_llama_config(spec: ModelSpec, vocab_size: Optional[int] = None, model_type: Optional[str] = None,
                    bos: Optional[int] = None, eos: Optional[int] = None, dtype: str = "float32",
                    init_std: float = 0.02) -> Dict[str, Any]:
    """``config.json`` of the Llama-family model ``spec`` describes (``model_type``: default
    :func:`llama_model_type`); ``vocab_size``: the rows to export (default the spec's). One line naming the option
    for a spec no such configuration holds."""
    model_type = model_type or llama_model_type(spec)
    if model_type not in ARCHITECTURES:
        raise CheckpointFormatError(f"model type {model_type!r}: not a Llama-family model ({', '.join(ARCHITECTURES)})")
    needs = [("normalization", "RMSNorm", "--normalization RMSNorm"),
             ("position_embedding_type", "rope", "--position-embedding-type rope"),
             ("swiglu", True, "--swiglu"), ("qk_layernorm", False, "no --qk-layernorm"),
             ("layernorm_zero_centered_gamma", False, "no --apply-layernorm-1p"),
             ("apply_residual_connection_post_layernorm", False, "pre-norm residuals")]
    for name, want, flag in needs:
        if getattr(spec, name) != want:
            raise CheckpointFormatError(f"a Hugging Face {ARCHITECTURES[model_type]} needs {flag} ({name} is "
                                        f"{getattr(spec, name)})")
    if model_type == "qwen2" and (spec.add_bias_linear or not spec.add_qkv_bias):
        raise CheckpointFormatError("a Hugging Face Qwen2ForCausalLM has biases on q, k, v only: it needs "
                                    "--disable-bias-linear --add-qkv-bias")
    if model_type != "qwen2" and spec.add_qkv_bias and not spec.add_bias_linear:
        raise CheckpointFormatError(f"a Hugging Face {ARCHITECTURES[model_type]} has no QKV-only bias "
                                    "(--add-qkv-bias): export it as qwen2")
    if model_type == "mistral" and spec.add_bias_linear:
        raise CheckpointFormatError("a Hugging Face MistralForCausalLM has no biases: it needs --disable-bias-linear")
    out: Dict[str, Any] = {
        "model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": vocab_size or spec.padded_vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.kv_channels, "hidden_act": "silu", "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.layernorm_epsilon, "rope_theta": float(spec.rotary_base),
        "tie_word_embeddings": spec.share_embeddings_and_output_weights, "initializer_range": init_std,
        "attention_dropout": 0.0, "torch_dtype": dtype, "bos_token_id": bos, "eos_token_id": eos,
    }
    if spec.rotary_percent != 1.0:
        out["partial_rotary_factor"] = spec.rotary_percent
    if spec.use_rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": spec.rope_scaling_factor, **LLAMA3_ROPE_SCALING}
    elif spec.rotary_seq_len_interpolation_factor is not None:
        out["rope_scaling"] = {"rope_type": "linear", "factor": spec.rotary_seq_len_interpolation_factor}
    else:
        out["rope_scaling"] = None
    if model_type == "llama":
        out.update(attention_bias=spec.add_bias_linear, mlp_bias=spec.add_bias_linear)
    elif model_type == "mistral":
        out["sliding_window"] = None
    else:
        out["use_sliding_window"] = False
    return out


# ---- folders -----------------------------------------------------------------------------------------------------
def hf_model_type(model_dir: str) -> Optional[str]:
    """``model_type`` of a Hugging Face folder's ``config.json`` (None without one)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("model_type")


def load_hf_llama(model_dir: str, make_vocab_size_divisible_by: int = 128
                  ) -> Tuple[Dict[str, torch.Tensor], ModelDims, Dict[str, Any], ModelSpec]:
    """``(full state dict, sizes, config dict, spec)`` of a Hugging Face Llama, Mistral or Qwen2 folder (no code is
    run); the vocabulary is padded by Megatron's rule at TP 1, the padding rows zeros."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    spec = spec_from_hf_llama_config(config, where=os.path.join(model_dir, "config.json"))
    vocab = spec.padded_vocab_size
    spec = dataclasses.replace(spec, padded_vocab_size=pad_vocab_size(vocab, make_vocab_size_divisible_by, 1))
    hf_sd = read_hf_weights(model_dir)
    full = from_hf_llama(hf_sd, spec, spec.padded_vocab_size)
    used = set(to_hf_llama(full, spec, vocab)) | {"lm_head.weight"}
    unknown = sorted(k for k in hf_sd if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unknown:
        architecture = ARCHITECTURES[config["model_type"]]
        raise CheckpointFormatError(f"{model_dir}: unknown tensor {unknown[0]} (not a {architecture} weight)")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    dims = dims_from_spec(spec, vocab_size=vocab, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                          params_dtype=dtype)
    return full, dims, config, spec


def save_hf_llama(out_dir: str, full: Dict[str, torch.Tensor], spec: ModelSpec, vocab_size: int,
                  bos: Optional[int] = None, eos: Optional[int] = None, dtype: str = "float32",
                  init_std: float = 0.02) -> List[str]:
    """Write a folder ``AutoModelForCausalLM.from_pretrained`` loads offline: ``config.json`` (the family of
    :func:`llama_model_type`), ``model.safetensors`` (``vocab_size`` real rows) and ``generation_config.json``."""
    from safetensors.torch import save_file

    config = hf_llama_config(spec, vocab_size=vocab_size, bos=bos, eos=eos, dtype=dtype, init_std=init_std)
    weights = to_hf_llama(full, spec, vocab_size)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.detach().to(torch_dtype).contiguous() for k, v in weights.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
    return sorted(os.listdir(out_dir))
