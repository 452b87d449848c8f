"""Megatron-LM checkpoints from before Megatron-Core (its ``megatron/model`` GPT and BERT), mapped to Core names.

Facts of the layout (the state dict's ``model`` entry; nested dicts, or the same keys joined by dots):

- ``language_model.embedding.{word,position,tokentype}_embeddings.weight``;
- the layers under ``language_model.encoder.layers.N.`` (``language_model.transformer.`` in the oldest files):
  ``input_layernorm``, ``attention.query_key_value`` (later ``self_attention.``), ``attention.dense``,
  ``post_attention_layernorm``, ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``, then ``final_layernorm``;
- GPT: the output weight is the word embedding (``language_model.output_layer.weight`` when untied);
- BERT: ``language_model.pooler.dense``, ``lm_head.dense``, ``lm_head.layernorm``, ``lm_head.bias`` (the
  vocabulary bias), ``binary_head``.

The fused QKV rows are ordered by ``checkpoint_version`` (0 when the file has none), with ``np`` heads of ``hn``
channels: version 0 stores ``[3, np, hn]`` (all queries, then keys, then values), version 1.0 ``[np, hn, 3]``,
versions 2.0 and 3.0 ``[np, 3, hn]`` (each head's query, key, value), which is Megatron-Core's ``linear_qkv`` order
for multi-head attention. Weights and biases are reordered along their first dimension.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Dict, Optional

import torch

from megatron.core.checkpoint_formats.layout import ModelFamily
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError

# the QKV rows' stored shape (in units of np, hn, 3) per checkpoint_version, as a permutation to [np, 3, hn]
_QKV_ORDER = {0: ("3", "np", "hn"), 1: ("np", "hn", "3"), 2: ("np", "3", "hn"), 3: ("np", "3", "hn")}
_LAYER = {"input_layernorm": "input_layernorm", "attention.query_key_value": "self_attention.linear_qkv",
          "self_attention.query_key_value": "self_attention.linear_qkv", "attention.dense": "self_attention.linear_proj",
          "self_attention.dense": "self_attention.linear_proj", "post_attention_layernorm": "pre_mlp_layernorm",
          "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
_GLOBAL = {"language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
           "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
           "language_model.embedding.tokentype_embeddings.weight": "embedding.tokentype_embeddings.weight",
           "language_model.output_layer.weight": "output_layer.weight",
           "language_model.pooler.dense.weight": "pooler.dense.weight",
           "language_model.pooler.dense.bias": "pooler.dense.bias",
           "lm_head.dense.weight": "lm_head.dense.weight", "lm_head.dense.bias": "lm_head.dense.bias",
           "lm_head.layernorm.weight": "lm_head.layer_norm.weight", "lm_head.layernorm.bias": "lm_head.layer_norm.bias",
           "lm_head.bias": "output_layer.bias",
           "binary_head.weight": "binary_head.weight", "binary_head.bias": "binary_head.bias"}
_STACK = re.compile(r"^language_model\.(?:encoder|transformer)\.(?:layers\.(\d+)\.(.+)|(final_layernorm\.\w+))$")


def _flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def is_precore(model_state: Dict[str, Any]) -> bool:
    """Whether a model state dict is in the pre-Core layout (a ``language_model`` entry or ``language_model.`` keys)."""
    return any(k == "language_model" or str(k).startswith("language_model.") for k in model_state)


def qkv_version(checkpoint_version: Any, where: str) -> int:
    version = 0 if checkpoint_version is None else float(checkpoint_version)
    if version not in (0.0, 1.0, 2.0, 3.0):
        raise CheckpointFormatError(f"{where}: checkpoint_version {checkpoint_version} is not one of 0, 1.0, 2.0, "
                                    "3.0 (its QKV order is unknown)")
    return int(version)


def qkv_to_core(tensor: torch.Tensor, checkpoint_version: Any, num_heads: int, where: str) -> torch.Tensor:
    """A fused QKV weight ``[3h, h]`` or bias ``[3h]`` of ``checkpoint_version``'s order in Megatron-Core's."""
    order = _QKV_ORDER[qkv_version(checkpoint_version, where)]
    rows = tensor.shape[0]
    if rows % (3 * num_heads):
        raise CheckpointFormatError(f"{where}: the QKV tensor has {rows} rows, not a multiple of 3 x "
                                    f"{num_heads} heads")
    sizes = {"3": 3, "np": num_heads, "hn": rows // (3 * num_heads)}
    stored = tensor.reshape(*(sizes[d] for d in order), *tensor.shape[1:])
    perm = [order.index(d) for d in ("np", "3", "hn")] + list(range(3, tensor.dim() + 2))
    return stored.permute(*perm).reshape(tensor.shape).contiguous()


def precore_to_core(model_state: Dict[str, Any], family: ModelFamily, num_heads: int, checkpoint_version: Any,
                    where: str) -> Dict[str, torch.Tensor]:
    """The pre-Core model state dict ``model_state`` under Megatron-Core names (QKV in Core's order)."""
    out: Dict[str, torch.Tensor] = {}
    for name, value in _flatten(model_state).items():
        if not torch.is_tensor(value):
            continue
        target = _GLOBAL.get(name)
        stacked = _STACK.match(name)
        if stacked and stacked.group(3):
            target = family.layer_prefix.split(".")[0] + "." + stacked.group(3)
        elif stacked:
            module, _, leaf = stacked.group(2).rpartition(".")
            if module in _LAYER:
                target = family.layer_name(int(stacked.group(1)), f"{_LAYER[module]}.{leaf}")
                if _LAYER[module] == "self_attention.linear_qkv":
                    value = qkv_to_core(value, checkpoint_version, num_heads, f"{where}: {name}")
        if target is None or not family.known(target):
            raise CheckpointFormatError(f"{where}: {name} is not a parameter of a pre-Core Megatron-LM "
                                        f"{family.name} checkpoint")
        out[target] = value
    return out


def precore_args(full: Dict[str, torch.Tensor], family: ModelFamily, num_heads: Optional[int],
                 where: str) -> Dict[str, Any]:
    """Model arguments read off the weights, for a file that stores none (the number of heads cannot be)."""
    if not num_heads:
        raise CheckpointFormatError(f"{where} stores no arguments; give the model's --num-attention-heads")
    words = full["embedding.word_embeddings.weight"]
    layers = 1 + max(family.split_layer_name(n)[0] for n in full if family.split_layer_name(n)[0] is not None)
    return {"num_layers": layers, "hidden_size": words.shape[1], "num_attention_heads": int(num_heads),
            "ffn_hidden_size": full[family.layer_name(0, "mlp.linear_fc1.weight")].shape[0],
            "max_position_embeddings": full["embedding.position_embeddings.weight"].shape[0],
            "padded_vocab_size": words.shape[0], "make_vocab_size_divisible_by": 1,
            "untie_embeddings_and_output_weights": "output_layer.weight" in full and family.name == "GPT",
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


def core_view(state: Dict[str, Any], family: ModelFamily, tp_size: int, num_heads: Optional[int],
              where: str) -> Dict[str, Any]:
    """A pre-Core file's state with its model chunk(s) under Core names and without its optimizer and RNG state
    (their layouts predate Megatron-Core's and are not mapped: such a file is read for its weights). ``tp_size``:
    the tensor-parallel size the file was saved at (each rank's QKV holds ``heads / tp_size`` heads);
    ``num_heads``: the model's heads when the file stores no ``args``. Any other state is returned unchanged."""
    chunks = [k for k in state if k == "model" or re.fullmatch(r"model\d+", str(k))]
    if not any(isinstance(state[k], dict) and is_precore(state[k]) for k in chunks):
        return state
    saved = state.get("args")
    heads = getattr(saved, "num_attention_heads", None) if saved is not None else num_heads
    if not heads:
        raise CheckpointFormatError(f"{where} stores no arguments; give the model's --num-attention-heads")
    if int(heads) % tp_size:
        raise CheckpointFormatError(f"{where}: {heads} attention heads do not split over {tp_size} tensor-parallel "
                                    "ranks")
    out = {k: v for k, v in state.items() if k not in ("optimizer", "rng_state", "random_rng_state",
                                                        "np_rng_state", "torch_rng_state", "cuda_rng_state",
                                                        "rng_tracker_states", "opt_param_scheduler", "lr_scheduler")}
    for k in chunks:
        out[k] = precore_to_core(state[k], family, int(heads) // tp_size, state.get("checkpoint_version"), where)
    if saved is None:
        out["args"] = argparse.Namespace(**precore_args(out[chunks[0]], family, heads, where))
    return out
