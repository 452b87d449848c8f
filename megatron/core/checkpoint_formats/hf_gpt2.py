"""Hugging Face GPT-2 (``GPT2LMHeadModel``) <-> our full GPT state dict.

Mapping (ours -> HF; HF's ``Conv1D`` stores ``[in, out]``, the transpose of our ``[out, in]`` linears):

=============================================  ==========================================================
``embedding.word_embeddings.weight``           ``transformer.wte.weight`` (vocabulary padding removed)
``embedding.position_embeddings.weight``       ``transformer.wpe.weight``
``layers.N.input_layernorm.*``                 ``transformer.h.N.ln_1.*``
``layers.N.self_attention.linear_qkv.*``       ``transformer.h.N.attn.c_attn.*`` (per-head [q k v] rows ->
                                               [all q | all k | all v] columns)
``layers.N.self_attention.linear_proj.*``      ``transformer.h.N.attn.c_proj.*``
``layers.N.pre_mlp_layernorm.*``               ``transformer.h.N.ln_2.*``
``layers.N.mlp.linear_fc1.*`` / ``fc2``        ``transformer.h.N.mlp.c_fc.*`` / ``c_proj``
``decoder.final_layernorm.*``                  ``transformer.ln_f.*``
``output_layer.weight`` (untied only)          ``lm_head.weight`` (tied: ``tie_word_embeddings``)
=============================================  ==========================================================

Our GeLU is the erf one (HF ``gelu``); ``--apply-layernorm-1p`` gammas are stored as ``gamma - 1`` and exported as
``gamma``. ``transformers`` is imported only when a model folder is written.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.checkpoint_formats.common import dims_from_spec, spec_of_dims
from megatron.core.checkpoint_formats.layout import ModelDims, pad_vocab_size
from megatron.core.checkpoint_formats.reshard import resize_vocab_rows
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError
from megatron.core.model_spec import ModelSpec

_LAYER_MAP = [  # (ours, HF, Conv1D transpose)
    ("input_layernorm.weight", "ln_1.weight", False), ("input_layernorm.bias", "ln_1.bias", False),
    ("self_attention.linear_proj.weight", "attn.c_proj.weight", True),
    ("self_attention.linear_proj.bias", "attn.c_proj.bias", False),
    ("pre_mlp_layernorm.weight", "ln_2.weight", False), ("pre_mlp_layernorm.bias", "ln_2.bias", False),
    ("mlp.linear_fc1.weight", "mlp.c_fc.weight", True), ("mlp.linear_fc1.bias", "mlp.c_fc.bias", False),
    ("mlp.linear_fc2.weight", "mlp.c_proj.weight", True), ("mlp.linear_fc2.bias", "mlp.c_proj.bias", False),
]
_LN_WEIGHTS = ("input_layernorm.weight", "pre_mlp_layernorm.weight")


def _qkv_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Our per-head [q k v] rows (``[3h, ...]``) -> HF's [q | k | v] blocks along the same dimension."""
    rest = tuple(w.shape[1:])
    d = w.shape[0] // (3 * heads)
    w = w.reshape((heads, 3, d) + rest)  # [n, 3, d, ...]
    return w.transpose(0, 1).reshape((3 * heads * d,) + rest)  # [3 * n * d, ...]


def _qkv_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    rest = tuple(w.shape[1:])
    d = w.shape[0] // (3 * heads)
    w = w.reshape((3, heads, d) + rest)  # [3, n, d, ...]
    return w.transpose(0, 1).reshape((3 * heads * d,) + rest)  # [n * 3 * d, ...]


def to_hf_gpt2(full: Dict[str, torch.Tensor], dims: ModelDims) -> Dict[str, torch.Tensor]:
    """Our full state dict -> a ``GPT2LMHeadModel`` state dict (without the tied ``lm_head``)."""
    if dims.vocab_size is None:
        raise CheckpointFormatError("the real vocabulary size is unknown (the checkpoint's arguments name no "
                                    "vocabulary file); pass --true-vocab-size or --vocab-file")
    one = 1.0 if dims.apply_layernorm_1p else 0.0
    n = dims.num_attention_heads
    out = {"transformer.wte.weight": full["embedding.word_embeddings.weight"][:dims.vocab_size],
           "transformer.wpe.weight": full["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": full["decoder.final_layernorm.weight"] + one,
           "transformer.ln_f.bias": full["decoder.final_layernorm.bias"]}
    for i in range(dims.num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        out[dst + "attn.c_attn.weight"] = _qkv_to_hf(full[src + "self_attention.linear_qkv.weight"], n).t()  # [h, 3h]
        out[dst + "attn.c_attn.bias"] = _qkv_to_hf(full[src + "self_attention.linear_qkv.bias"], n)
        for ours, hf, transpose in _LAYER_MAP:
            t = full[src + ours]
            if ours in _LN_WEIGHTS:
                t = t + one
            out[dst + hf] = t.t() if transpose else t
    if not dims.tied_embeddings:
        out["lm_head.weight"] = full["output_layer.weight"][:dims.vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


# the spec of every GPT-2 (the options its config.json cannot change)
GPT2_OPTIONS = dict(normalization="LayerNorm", position_embedding_type="learned_absolute", gated_linear_unit=False,
                    activation="gelu", add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False,
                    layernorm_zero_centered_gamma=False, apply_residual_connection_post_layernorm=False,
                    attention_mask_type="causal")


def check_spec_options(spec: ModelSpec, options: dict, model: str) -> None:
    """Refuse, naming the field, a spec with an option ``model``'s configuration cannot hold."""
    for name, want in options.items():
        if getattr(spec, name) != want:
            raise CheckpointFormatError(f"a Hugging Face {model} cannot hold {name} = {getattr(spec, name)} "
                                        f"(it has {want})")
    if spec.num_query_groups != spec.num_attention_heads or spec.kv_channels * spec.num_attention_heads != \
            spec.hidden_size:
        raise CheckpointFormatError(f"a Hugging Face {model} has one key/value head of hidden_size / heads channels "
                                    "per query head")


def hf_gpt2_config(spec: ModelSpec, vocab_size: Optional[int], eod: Optional[int],
                   dropout: Tuple[float, float] = (0.0, 0.0), init_std: float = 0.02) -> dict:
    """``config.json`` of the GPT-2 ``spec`` describes, with ``vocab_size`` real rows (default: the spec's)."""
    options = dict(GPT2_OPTIONS)
    options.pop("layernorm_zero_centered_gamma")  # exported as gamma (plus one)
    check_spec_options(spec, options, "GPT2LMHeadModel")
    hidden_dropout, attention_dropout = dropout
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab_size or spec.padded_vocab_size,
        "n_positions": spec.max_position_embeddings, "n_embd": spec.hidden_size, "n_layer": spec.num_layers,
        "n_head": spec.num_attention_heads, "n_inner": spec.ffn_hidden_size, "activation_function": "gelu",
        "layer_norm_epsilon": spec.layernorm_epsilon, "resid_pdrop": hidden_dropout, "embd_pdrop": hidden_dropout,
        "attn_pdrop": attention_dropout, "initializer_range": init_std, "scale_attn_weights": True,
        "tie_word_embeddings": spec.share_embeddings_and_output_weights, "bos_token_id": eod, "eos_token_id": eod,
    }


def spec_from_hf_gpt2_config(config: dict, make_vocab_size_divisible_by: int = 128) -> ModelSpec:
    """The ``ModelSpec`` of a GPT-2 ``config.json`` (the vocabulary padded by Megatron's rule at TP 1)."""
    n_positions = int(config["n_positions"])
    return ModelSpec(num_layers=int(config["n_layer"]), hidden_size=int(config["n_embd"]),
                     num_attention_heads=int(config["n_head"]),
                     ffn_hidden_size=int(config.get("n_inner") or 4 * int(config["n_embd"])),
                     seq_length=n_positions, max_position_embeddings=n_positions,
                     padded_vocab_size=pad_vocab_size(int(config["vocab_size"]), make_vocab_size_divisible_by, 1),
                     layernorm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
                     share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", True)),
                     **GPT2_OPTIONS)


def build_hf_gpt2(full: Dict[str, torch.Tensor], dims: ModelDims, eod: Optional[int] = None,
                  dropout: Tuple[float, float] = (0.0, 0.0), init_std: float = 0.02,
                  dtype: Optional[torch.dtype] = None, attn_implementation: Optional[str] = None):
    """A ``transformers.GPT2LMHeadModel`` holding ``full`` (our full state dict, real vocabulary rows only), in
    ``dtype`` (default: the model's ``params_dtype``), on the tensors' device."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_sd = to_hf_gpt2(full, dims)
    if dtype is None:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dims.params_dtype, torch.float32)
    spec = spec_of_dims(dims)
    cfg = {k: v for k, v in hf_gpt2_config(spec, dims.vocab_size, eod, dropout, init_std).items()
           if k not in ("model_type", "architectures")}
    with torch.device("meta"):  # no random initialisation: every weight is assigned below
        model = GPT2LMHeadModel(GPT2Config(**cfg))
    if attn_implementation is not None:
        model.config._attn_implementation = attn_implementation
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in hf_sd.items()}, strict=False,
                                                assign=True)
    tied_head = "lm_head.weight" if dims.tied_embeddings else None
    missing = [k for k in missing if k != tied_head]
    if missing or unexpected:
        raise CheckpointFormatError(f"GPT-2 export does not fit transformers' GPT2LMHeadModel: missing "
                                    f"{missing[:3]}, unexpected {unexpected[:3]}")
    if dims.tied_embeddings:
        model.tie_weights()
    return model.eval()


def save_hf_gpt2(out_dir: str, full: Dict[str, torch.Tensor], dims: ModelDims, eod: Optional[int] = None,
                 vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                 dropout: Tuple[float, float] = (0.0, 0.0), init_std: float = 0.02) -> List[str]:
    """Write a folder ``AutoModelForCausalLM.from_pretrained`` loads offline: ``config.json``,
    ``model.safetensors``, ``generation_config.json`` and, given GPT-2 BPE files, the tokenizer files."""
    from transformers import GenerationConfig

    model = build_hf_gpt2(full, dims, eod, dropout, init_std)
    model.generation_config = GenerationConfig(bos_token_id=eod, eos_token_id=eod, pad_token_id=eod)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if vocab_file and merge_file:
        shutil.copyfile(vocab_file, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(merge_file, os.path.join(out_dir, "merges.txt"))
        special = "<|endoftext|>"
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": dims.max_position_embeddings,
                       "bos_token": special, "eos_token": special, "unk_token": special,
                       "add_prefix_space": False}, f, indent=2)
        with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
            json.dump({"bos_token": special, "eos_token": special, "unk_token": special}, f, indent=2)
    return sorted(os.listdir(out_dir))


# ---- import ---------------------------------------------------------------------------------------------------------
def _check_config(config: dict, where: str) -> List[str]:
    """Refuse GPT-2 variants our model cannot express; return notes on approximations."""
    if config.get("model_type") != "gpt2":
        raise CheckpointFormatError(f"{where}: model_type {config.get('model_type')!r} is not supported "
                                    "(the Hugging Face loader reads GPT-2 checkpoints: model_type 'gpt2')")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if key in config and bool(config[key]) != want:
            raise CheckpointFormatError(f"{where}: {key}={config[key]} is not supported (needs {want})")
    act = config.get("activation_function", "gelu_new")
    notes = []
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        notes.append(f"activation_function {act} (tanh GeLU) runs as our erf GeLU (differences up to ~1e-3 per "
                     "activation)")
    elif act != "gelu":
        raise CheckpointFormatError(f"{where}: activation_function {act!r} is not supported (gelu or gelu_new)")
    return notes


def from_hf_gpt2(hf_sd: Dict[str, torch.Tensor], config: dict, make_vocab_size_divisible_by: int = 128,
                 where: str = "Hugging Face checkpoint") -> Tuple[Dict[str, torch.Tensor], ModelDims, List[str]]:
    """A GPT-2 state dict and its ``config.json`` -> ``(our full state dict, sizes, notes)``."""
    notes = _check_config(config, where)
    sd = {(k[len("transformer."):] if k.startswith("transformer.") else k): v for k, v in hf_sd.items()}
    spec = spec_from_hf_gpt2_config(config, make_vocab_size_divisible_by)
    n_layer, heads = spec.num_layers, spec.num_attention_heads
    dims = dims_from_spec(spec, vocab_size=int(config["vocab_size"]),
                          make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                          params_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"))

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise CheckpointFormatError(f"{where}: tensor {key} is missing")
        return sd.pop(key)

    full = {"embedding.word_embeddings.weight": resize_vocab_rows(take("wte.weight"), dims.padded_vocab_size),
            "embedding.position_embeddings.weight": take("wpe.weight")}
    for i in range(n_layer):
        src, dst = f"h.{i}.", f"decoder.layers.{i}."
        full[dst + "input_layernorm.weight"] = take(src + "ln_1.weight")
        full[dst + "input_layernorm.bias"] = take(src + "ln_1.bias")
        full[dst + "self_attention.linear_qkv.weight"] = _qkv_from_hf(take(src + "attn.c_attn.weight").t(), heads)
        full[dst + "self_attention.linear_qkv.bias"] = _qkv_from_hf(take(src + "attn.c_attn.bias"), heads)
        for ours, hf, transpose in _LAYER_MAP:
            if ours.startswith("input_layernorm"):
                continue
            t = take(src + hf)
            full[dst + ours] = t.t() if transpose else t
        for buf in ("attn.bias", "attn.masked_bias"):  # causal-mask buffers of older transformers versions
            sd.pop(src + buf, None)
    full["decoder.final_layernorm.weight"] = take("ln_f.weight")
    full["decoder.final_layernorm.bias"] = take("ln_f.bias")
    head = sd.pop("lm_head.weight", None)
    if not spec.share_embeddings_and_output_weights:
        if head is None:
            raise CheckpointFormatError(f"{where}: tie_word_embeddings is false but lm_head.weight is missing")
        full["output_layer.weight"] = resize_vocab_rows(head, dims.padded_vocab_size)
    if sd:
        raise CheckpointFormatError(f"{where}: unknown tensor {sorted(sd)[0]} (not a GPT2LMHeadModel weight)")
    return {k: v.contiguous() for k, v in full.items()}, dims, notes


def read_hf_weights(model_dir: str) -> Dict[str, torch.Tensor]:
    """Tensors of ``model.safetensors`` (sharded or not) or ``pytorch_model.bin`` (read with weights_only)."""
    from safetensors.torch import load_file

    def index_files(name: str) -> Optional[List[str]]:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return sorted(set(json.load(f)["weight_map"].values()))

    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        names = [single] if os.path.isfile(os.path.join(model_dir, single)) else index_files(index)
        if not names:
            continue
        out = {}
        for name in names:
            path = os.path.join(model_dir, name)
            if name.endswith(".safetensors"):
                out.update(load_file(path))
            else:
                try:
                    out.update(torch.load(path, map_location="cpu", weights_only=True))
                except Exception as exc:
                    raise CheckpointFormatError(f"refusing {path}: it is not a plain tensor file "
                                                f"({type(exc).__name__})") from exc
        return out
    raise CheckpointFormatError(f"{model_dir} holds no model.safetensors, pytorch_model.bin or their index files")


def load_hf_gpt2(model_dir: str, make_vocab_size_divisible_by: int = 128):
    """``(full state dict, sizes, config dict, notes)`` of a Hugging Face GPT-2 folder (no code is run)."""
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointFormatError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    with open(cfg_path) as f:
        config = json.load(f)
    full, dims, notes = from_hf_gpt2(read_hf_weights(model_dir), config, make_vocab_size_divisible_by,
                                     where=model_dir)
    return full, dims, config, notes
