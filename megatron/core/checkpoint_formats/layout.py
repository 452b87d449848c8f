"""What a model's checkpoint holds: parameter names, their tensor-parallel split, their order, their shapes.

A :class:`ModelFamily` describes one model type (GPT here; BERT registers its own with :func:`register_family`).
The resharding, the Megatron-LM reader/writer and the converter only consult the family, so a new model type needs
a family, not new conversion code. :class:`ModelDims` carries the sizes that fix every full (unsharded) shape.
"""

from __future__ import annotations

import dataclasses

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError
from megatron.core.tensor_parallel.sharding import TPSharding, fc1_sharding, qkv_sharding


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` at or above ``vocab_size`` (Megatron's padding rule)."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass
class ModelDims:
    """The sizes of a model, independent of its parallel layout."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    max_position_embeddings: int
    padded_vocab_size: int  # rows of the embedding as stored (padding included)
    vocab_size: Optional[int] = None  # the tokenizer's vocabulary (rows that are real tokens), when known
    make_vocab_size_divisible_by: int = 128
    seq_length: Optional[int] = None
    layernorm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    tied_embeddings: bool = True
    params_dtype: str = "float32"
    # what decides how the fused linears are split over tensor-parallel ranks (TransformerConfig's names)
    num_query_groups: Optional[int] = None  # None: one per attention head
    kv_channels: Optional[int] = None  # None: hidden_size // num_attention_heads
    gated_linear_unit: bool = False

    def padded_for(self, tp_size: int) -> int:
        """Embedding rows at ``tp_size``: the real vocabulary padded by Megatron's rule (when the real size is
        unknown, the stored rows are kept and padded further only if ``tp_size`` needs it)."""
        base = self.vocab_size if self.vocab_size is not None else self.padded_vocab_size
        padded = pad_vocab_size(base, self.make_vocab_size_divisible_by, tp_size)
        if self.vocab_size is None and self.padded_vocab_size % tp_size == 0:
            return self.padded_vocab_size
        return padded

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ModelFamily:
    """Parameter layout of one model type in Megatron-Core naming."""

    name: str
    layer_prefix: str  # "decoder.layers." (GPT) / "encoder.layers." (BERT)
    # names in our module order; layer-relative names are below ``layer_prefix + N.``
    first_stage: List[str]  # parameters held by the first pipeline stage (embeddings)
    layer: List[str]  # one transformer layer, in our module order
    last_stage: List[str]  # parameters held by the last pipeline stage (final norm, heads)
    # name (layer-relative or global) -> partition dimension over tensor-parallel ranks (absent: replicated)
    tp_dim: Dict[str, int]
    vocab_params: Tuple[str, ...]  # rows are the (padded) vocabulary
    tied_output: str = "output_layer.weight"  # the output weight that is a tied copy of the word embeddings
    # Megatron-Core's module order of a layer, where it differs from ours (it decides the optimizer's order)
    megatron_layer: List[str] = field(default_factory=list)
    # modules whose Megatron-Core state dict carries an ``_extra_state`` entry
    megatron_extra_state_layer: List[str] = field(default_factory=list)
    megatron_extra_state_global: List[str] = field(default_factory=list)
    shapes: Optional[Callable[["ModelDims"], dict]] = None  # dims -> {name: full shape}
    # Megatron-Core's order of the last stage's parameters, where it differs from ours
    megatron_last_stage: List[str] = field(default_factory=list)
    # parameters that a model may lack as a group (all of a group present, or none), e.g. BERT's binary head
    optional_groups: List[Tuple[str, ...]] = field(default_factory=list)
    # parameters (layer-relative or global) that the model's options decide one by one: biases, norms' biases,
    # position embeddings, per-head query/key norms
    optional_params: Tuple[str, ...] = ()

    def is_optional(self, name: str) -> bool:
        return (any(name in group for group in self.optional_groups) or name in self.optional_params
                or self.split_layer_name(name)[1] in self.optional_params)

    def tp_sharding(self, name: str, dims: "ModelDims") -> Optional[TPSharding]:
        """How ``name`` is split over tensor-parallel ranks (None: replicated), the declaration the layers make
        (``tensor_parallel.TPSharding``): the SwiGLU's ``[gate; up]`` weight per rank, the grouped QKV in whole
        query groups, everything else a contiguous slice along its partition dimension."""
        dim = self.partition_dim(name)
        if dim is None:
            return None
        rel = self.split_layer_name(name)[1]
        if rel.startswith("mlp.linear_fc1."):
            return fc1_sharding(dims.gated_linear_unit)
        if rel.startswith("self_attention.linear_qkv."):
            return qkv_sharding(dims.num_attention_heads, dims.num_query_groups or dims.num_attention_heads,
                                dims.kv_channels or dims.hidden_size // dims.num_attention_heads)
        return TPSharding(dim)

    def split_layer_name(self, name: str) -> Tuple[Optional[int], str]:
        """``decoder.layers.3.mlp.linear_fc1.weight`` -> ``(3, "mlp.linear_fc1.weight")``; ``(None, name)``
        for a parameter outside the layers."""
        m = re.match(re.escape(self.layer_prefix) + r"(\d+)\.(.+)$", name)
        return (int(m.group(1)), m.group(2)) if m else (None, name)

    def layer_name(self, index: int, rel: str) -> str:
        return f"{self.layer_prefix}{index}.{rel}"

    def partition_dim(self, name: str) -> Optional[int]:
        return self.tp_dim.get(self.split_layer_name(name)[1])

    def is_vocab(self, name: str) -> bool:
        return name in self.vocab_params

    def known(self, name: str) -> bool:
        index, rel = self.split_layer_name(name)
        if index is not None:
            return rel in self.layer
        return name in self.first_stage or name in self.last_stage

    def full_order(self, num_layers: int, tied: bool) -> List[str]:
        """Every parameter of the full model in our module order (the tied output weight left out)."""
        names = list(self.first_stage)
        for i in range(num_layers):
            names += [self.layer_name(i, rel) for rel in self.layer]
        names += [n for n in self.last_stage if not (tied and n == self.tied_output)]
        return names

    def check_shapes(self, full: dict, dims: ModelDims, where: str) -> None:
        """Raise naming the first parameter whose full shape does not fit ``dims`` (or that is missing/unknown)."""
        for name in full:
            if not self.known(name):
                raise CheckpointFormatError(f"{where}: unknown {self.name} parameter {name}")
        absent = set()
        for group in self.optional_groups:
            held = [n for n in group if n in full]
            if held and len(held) != len(group):
                missing = [n for n in group if n not in full]
                raise CheckpointFormatError(f"{where}: {self.name} parameter {missing[0]} is missing (it comes "
                                            f"with {held[0]})")
            if not held:
                absent.update(group)
        expected = self.shapes(dims) if self.shapes is not None else {}
        for name, shape in expected.items():
            if name not in full:
                if (name == self.tied_output and dims.tied_embeddings) or name in absent or self.is_optional(name):
                    continue
                raise CheckpointFormatError(f"{where}: {self.name} parameter {name} is missing")
            if tuple(full[name].shape) != tuple(shape):
                raise CheckpointFormatError(f"{where}: {name} has shape {tuple(full[name].shape)}, expected "
                                            f"{tuple(shape)} from the model's sizes")


def _gpt_shapes(d: ModelDims) -> dict:
    h, f = d.hidden_size, d.ffn_hidden_size
    groups = d.num_query_groups or d.num_attention_heads
    kv = d.kv_channels or h // d.num_attention_heads
    q, qkv = d.num_attention_heads * kv, (d.num_attention_heads + 2 * groups) * kv  # grouped-query attention
    fc1 = 2 * f if d.gated_linear_unit else f  # SwiGLU: [gate; up]
    out = {"embedding.word_embeddings.weight": (d.padded_vocab_size, h),
           "embedding.position_embeddings.weight": (d.max_position_embeddings, h),
           "decoder.final_layernorm.weight": (h,), "decoder.final_layernorm.bias": (h,)}
    if not d.tied_embeddings:
        out["output_layer.weight"] = (d.padded_vocab_size, h)
    per_layer = {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
                 "self_attention.linear_qkv.weight": (qkv, h), "self_attention.linear_qkv.bias": (qkv,),
                 "self_attention.linear_proj.weight": (h, q), "self_attention.linear_proj.bias": (h,),
                 "self_attention.q_layernorm.weight": (kv,), "self_attention.q_layernorm.bias": (kv,),
                 "self_attention.k_layernorm.weight": (kv,), "self_attention.k_layernorm.bias": (kv,),
                 "pre_mlp_layernorm.weight": (h,), "pre_mlp_layernorm.bias": (h,),
                 "mlp.linear_fc1.weight": (fc1, h), "mlp.linear_fc1.bias": (fc1,),
                 "mlp.linear_fc2.weight": (h, f), "mlp.linear_fc2.bias": (h,)}
    for i in range(d.num_layers):
        out.update({f"decoder.layers.{i}.{k}": v for k, v in per_layer.items()})
    return out


_GPT_LAYER = ["input_layernorm.weight", "input_layernorm.bias",
              "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
              "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
              "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
              "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
              "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
              "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]

# decided by the model's options: rotary/no position embedding, RMSNorm (no norm biases), no linear biases,
# per-head query/key norms (LayerNorm: weight and bias; RMSNorm: weight)
_GPT_OPTIONAL = ("embedding.position_embeddings.weight", "decoder.final_layernorm.bias",
                 "input_layernorm.bias", "pre_mlp_layernorm.bias", "self_attention.linear_qkv.bias",
                 "self_attention.linear_proj.bias", "mlp.linear_fc1.bias", "mlp.linear_fc2.bias",
                 "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                 "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias")

GPT = ModelFamily(
    name="GPT",
    layer_prefix="decoder.layers.",
    first_stage=["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"],
    layer=_GPT_LAYER,
    last_stage=["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"],
    tp_dim={"embedding.word_embeddings.weight": 0, "output_layer.weight": 0,
            "self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
            "mlp.linear_fc1.weight": 0, "mlp.linear_fc1.bias": 0,
            "self_attention.linear_proj.weight": 1, "mlp.linear_fc2.weight": 1},
    vocab_params=("embedding.word_embeddings.weight", "output_layer.weight"),
    # Megatron-Core's SelfAttention registers linear_proj before linear_qkv
    megatron_layer=["input_layernorm.weight", "input_layernorm.bias",
                    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
                    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"],
    megatron_extra_state_layer=["self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                                "mlp.linear_fc2"],
    megatron_extra_state_global=["output_layer"],
    shapes=_gpt_shapes,
    optional_params=_GPT_OPTIONAL,
)


def _bert_shapes(d: ModelDims) -> dict:
    h, v = d.hidden_size, d.padded_vocab_size
    gpt = _gpt_shapes(d)
    out = {k.replace("decoder.", "encoder.", 1): s for k, s in gpt.items() if k != "output_layer.weight"}
    out.update({"embedding.tokentype_embeddings.weight": (2, h), "lm_head.dense.weight": (h, h),
                "lm_head.dense.bias": (h,), "lm_head.layer_norm.weight": (h,), "lm_head.layer_norm.bias": (h,),
                "output_layer.bias": (v,), "pooler.dense.weight": (h, h), "pooler.dense.bias": (h,),
                "binary_head.weight": (2, h), "binary_head.bias": (2,)})
    if not d.tied_embeddings:
        out["output_layer.weight"] = (v, h)
    return out


_BERT_HEADS = ["encoder.final_layernorm.weight", "encoder.final_layernorm.bias", "lm_head.dense.weight",
               "lm_head.dense.bias", "lm_head.layer_norm.weight", "lm_head.layer_norm.bias"]

# Megatron-Core's BertModel; ``--bert-no-binary-head`` models lack the token-type embedding, pooler and binary head
BERT = ModelFamily(
    name="BERT",
    layer_prefix="encoder.layers.",
    first_stage=["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                 "embedding.tokentype_embeddings.weight"],
    layer=_GPT_LAYER,
    # our BertModel registers the vocabulary bias before the (untied) output weight, the pooler before the head
    last_stage=_BERT_HEADS + ["output_layer.bias", "output_layer.weight", "pooler.dense.weight", "pooler.dense.bias",
                              "binary_head.weight", "binary_head.bias"],
    tp_dim=dict(GPT.tp_dim, **{"output_layer.bias": 0}),
    vocab_params=("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias"),
    megatron_layer=GPT.megatron_layer,
    optional_params=tuple(n for n in _GPT_OPTIONAL if "q_layernorm" in n or "k_layernorm" in n),
    megatron_extra_state_layer=GPT.megatron_extra_state_layer,
    megatron_extra_state_global=["output_layer"],
    shapes=_bert_shapes,
    # Megatron-Core: ColumnParallelLinear registers weight before bias; the binary head before the pooler
    megatron_last_stage=_BERT_HEADS + ["output_layer.weight", "output_layer.bias", "binary_head.weight",
                                       "binary_head.bias", "pooler.dense.weight", "pooler.dense.bias"],
    optional_groups=[("embedding.tokentype_embeddings.weight", "pooler.dense.weight", "pooler.dense.bias",
                      "binary_head.weight", "binary_head.bias")],
)

# a fine-tuned BERT (``megatron/core/models/bert_heads.py``): the encoder, the pooler and one task head, replicated
# over tensor-parallel ranks; no pre-training heads
BERT_FINETUNED = dataclasses.replace(
    BERT, name="BERT-finetuned",
    last_stage=["encoder.final_layernorm.weight", "encoder.final_layernorm.bias", "pooler.dense.weight",
                "pooler.dense.bias", "classification_head.weight", "classification_head.bias",
                "multichoice_head.weight", "multichoice_head.bias"],
    vocab_params=("embedding.word_embeddings.weight",), shapes=None, megatron_last_stage=[], optional_groups=[])

_FAMILIES: Dict[str, ModelFamily] = {"GPT": GPT, "BERT": BERT}


def register_family(family: ModelFamily) -> None:
    """Make ``family`` available to the readers, writers and ``tools/checkpoint/convert.py --model-type``."""
    _FAMILIES[family.name] = family


def get_family(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise CheckpointFormatError(f"--model-type {name}: no checkpoint layout is registered for it "
                                    f"(available: {', '.join(sorted(_FAMILIES))})")
    return _FAMILIES[name]


def families() -> List[str]:
    return sorted(_FAMILIES)


def check_supported_args(args: Dict[str, Any], where: str) -> None:
    """Refuse, by flag, the architectures whose weights our models cannot hold (the options the model description
    covers are checked by ``model_spec.spec_from_args``)."""
    refusals = [
        ("num_experts", lambda v: v not in (None, 0, 1), "unset"),
        ("transformer_impl", lambda v: v not in (None, "local", "transformer_engine"), "local"),
        ("multi_latent_attention", lambda v: bool(v), "off"),
    ]
    for key, bad, want in refusals:
        if key in args and bad(args[key]):
            raise CheckpointFormatError(f"{where}: --{key.replace('_', '-')} {args[key]} is not supported "
                                        f"(our models need {want})")
