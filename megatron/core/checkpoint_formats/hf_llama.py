"""Hugging Face Llama-family configurations (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``) <-> ``ModelSpec``.

The mapping of the model description only; the weights' mapping (grouped QKV, the fused gate/up, the rotary
layout) lives with the layers that hold them. Facts used:

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

from typing import Any, Dict, Optional

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
