"""The one description of a model: its sizes and architectural options, in Megatron-Core's names.

``ModelSpec`` is frozen and holds plain types only, so it is stored in checkpoints as a dict and compared with
``==``. Every consumer reads it: ``TransformerConfig`` (the spec plus runtime switches), the trainer's model
section, our checkpoints, Megatron-LM's ``args`` (read with :func:`spec_from_args`, written with
:func:`spec_to_args`), the Hugging Face configurations (``checkpoint_formats/hf_*.py``), the inference loader, and
the parameter and FLOP counts (``model_counts.py``) used by the log line, ``--dry-run``, the planner and ``bench/``.

An option that is not stated takes Megatron-Core's default; ``__post_init__`` fills the derived sizes
(``num_query_groups``, ``kv_channels``, ``ffn_hidden_size``, ``max_position_embeddings``), so readers always see
integers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
ACTIVATIONS = ("gelu", "silu")
ATTENTION_MASK_TYPES = ("causal", "padding")


def _derived(spec: "ModelSpec", name: str, value) -> None:
    object.__setattr__(spec, name, value)


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None  # key/value heads (grouped-query attention); None: one per query head
    kv_channels: Optional[int] = None  # channels per attention head; None: hidden_size / num_attention_heads
    ffn_hidden_size: Optional[int] = None  # MLP inner size; None: 4 x hidden_size
    seq_length: int = 1024
    max_position_embeddings: Optional[int] = None  # None: seq_length
    padded_vocab_size: int = 0  # rows of the word embedding (the tokenizer's vocabulary, padded)
    normalization: str = "LayerNorm"  # or "RMSNorm" (no bias)
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False  # the norm weight is stored as gamma - 1 (--apply-layernorm-1p)
    position_embedding_type: str = "learned_absolute"  # "rope" or "none": no position table
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # fraction of each head's channels that are rotated
    rotary_interleaved: bool = False  # rotate channel pairs (2i, 2i+1) instead of (i, i + d/2)
    rotary_seq_len_interpolation_factor: Optional[float] = None  # positions divided by this (linear scaling)
    use_rope_scaling: bool = False  # Llama 3.1's frequency scaling (low 1, high 4, original context 8192)
    rope_scaling_factor: float = 8.0
    gated_linear_unit: bool = False  # MLP input projection is [gate; up], activation(gate) * up
    activation: str = "gelu"  # "gelu" or "silu" (with gated_linear_unit: SwiGLU)
    add_bias_linear: bool = True  # biases on every linear layer
    add_qkv_bias: bool = False  # a bias on the QKV projection even without add_bias_linear (Qwen2)
    share_embeddings_and_output_weights: bool = True  # the output layer reuses the word embedding
    qk_layernorm: bool = False  # normalise each query and key head before the scores
    apply_residual_connection_post_layernorm: bool = False  # residual from the norm's output (post-LN BERT)
    attention_mask_type: str = "causal"  # or "padding" (bidirectional, BERT)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}")
        heads = self.num_attention_heads
        if self.num_query_groups is None:
            _derived(self, "num_query_groups", heads)
        if self.num_query_groups < 1 or heads % self.num_query_groups:
            raise ValueError(f"--num-attention-heads ({heads}) must be a multiple of --num-query-groups "
                             f"({self.num_query_groups})")
        if self.kv_channels is None:
            if self.hidden_size % heads:
                raise ValueError(f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                                 f"({heads}), or give --kv-channels")
            _derived(self, "kv_channels", self.hidden_size // heads)
        if self.kv_channels < 1:
            raise ValueError(f"--kv-channels must be >= 1, got {self.kv_channels}")
        if self.ffn_hidden_size is None:
            _derived(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.ffn_hidden_size < 1:
            raise ValueError(f"--ffn-hidden-size must be >= 1, got {self.ffn_hidden_size}")
        if self.max_position_embeddings is None:
            _derived(self, "max_position_embeddings", self.seq_length)
        if self.padded_vocab_size < 0:
            raise ValueError(f"the padded vocabulary size must be >= 0, got {self.padded_vocab_size}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization}")
        if not self.layernorm_epsilon > 0:
            raise ValueError(f"--norm-epsilon must be above 0, got {self.layernorm_epsilon}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"--position-embedding-type must be one of {', '.join(POSITION_EMBEDDING_TYPES)}, "
                             f"got {self.position_embedding_type}")
        if self.position_embedding_type == "learned_absolute" and self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                             f"({self.max_position_embeddings})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)} (--swiglu: silu), "
                             f"got {self.activation}")
        if self.attention_mask_type not in ATTENTION_MASK_TYPES:
            raise ValueError(f"attention mask type must be one of {', '.join(ATTENTION_MASK_TYPES)}, "
                             f"got {self.attention_mask_type}")
        self._check_rope()

    def _check_rope(self) -> None:
        rope = self.position_embedding_type == "rope"
        if not rope:
            for name, default in (("rotary_percent", 1.0), ("rotary_interleaved", False),
                                  ("rotary_seq_len_interpolation_factor", None), ("use_rope_scaling", False)):
                if getattr(self, name) != default:
                    raise ValueError(f"--{name.replace('_', '-')} needs --position-embedding-type rope")
            return
        if not self.rotary_base > 0:
            raise ValueError(f"--rotary-base must be above 0, got {self.rotary_base}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_dim % 2:
            raise ValueError(f"--rotary-percent ({self.rotary_percent}) x --kv-channels ({self.kv_channels}) = "
                             f"{self.kv_channels * self.rotary_percent:g} rotated channels per head; must be even")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and not factor >= 1.0:
            raise ValueError(f"--rotary-seq-len-interpolation-factor must be >= 1, got {factor}")
        if not self.rope_scaling_factor > 0:
            raise ValueError(f"--rope-scaling-factor must be above 0, got {self.rope_scaling_factor}")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """The shape constraints of splitting this model over ``tp_size`` tensor-parallel ranks (Megatron's: query
        heads, key/value groups and the MLP split evenly)."""
        for name, flag in (("num_attention_heads", "--num-attention-heads"), ("num_query_groups", "--num-query-groups"),
                           ("ffn_hidden_size", "--ffn-hidden-size")):
            if getattr(self, name) % tp_size:
                raise ValueError(f"{flag} ({getattr(self, name)}) must be divisible by "
                                 f"--tensor-model-parallel-size ({tp_size})")

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_projection_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def swiglu(self) -> bool:
        return self.gated_linear_unit and self.activation == "silu"

    @property
    def spec(self) -> "ModelSpec":
        """The plain ``ModelSpec`` (on a subclass such as ``TransformerConfig``: without its runtime fields)."""
        if type(self) is ModelSpec:
            return self
        return ModelSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelSpec)})

    def to_dict(self) -> Dict[str, Any]:
        """Plain types only (what our checkpoints store under ``model_spec``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelSpec)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelSpec":
        known = {f.name for f in dataclasses.fields(ModelSpec)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model description field {unknown[0]} (a newer checkpoint?)")
        return ModelSpec(**dict(values))


def spec_fields() -> tuple:
    """The field names of ``ModelSpec``, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(ModelSpec))


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's MLP size for ``--swiglu`` without ``--ffn-hidden-size``: 2/3 of 4h, rounded down to 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def _get(args: Mapping[str, Any], key: str, default):
    value = args.get(key)
    return default if value is None else value


def spec_from_args(args: Mapping[str, Any], **overrides: Any) -> ModelSpec:
    """The spec of a run described by Megatron-LM flag values (our parsed flags, the ``args`` stored in our older
    checkpoints or in Megatron-LM's, as a dict). Absent options take Megatron-LM's defaults; ``overrides`` are spec
    fields given directly (e.g. ``padded_vocab_size``, ``attention_mask_type``)."""
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if args.get(k) is None]
    if missing:
        raise ValueError(f"--{missing[0].replace('_', '-')} is not set")
    h = int(args["hidden_size"])
    swiglu = bool(args.get("swiglu", False))
    ffn = args.get("ffn_hidden_size")
    if ffn is None:
        ffn = swiglu_ffn_hidden_size(h) if swiglu else 4 * h
    seq = args.get("seq_length") or args.get("max_position_embeddings") or 1024
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    pos = _get(args, "position_embedding_type", "learned_absolute")
    if args.get("add_position_embedding") is False and pos == "learned_absolute":
        pos = "none"
    interp = args.get("rotary_seq_len_interpolation_factor")
    values = dict(
        num_layers=int(args["num_layers"]), hidden_size=h, num_attention_heads=int(args["num_attention_heads"]),
        num_query_groups=None if groups is None else int(groups),
        kv_channels=None if args.get("kv_channels") is None else int(args["kv_channels"]),
        ffn_hidden_size=int(ffn), seq_length=int(seq),
        max_position_embeddings=None if args.get("max_position_embeddings") is None
        else int(args["max_position_embeddings"]),
        padded_vocab_size=int(_get(args, "padded_vocab_size", 0)),
        normalization=str(_get(args, "normalization", "LayerNorm")),
        layernorm_epsilon=float(_get(args, "norm_epsilon", _get(args, "layernorm_epsilon", 1e-5))),
        layernorm_zero_centered_gamma=bool(args.get("apply_layernorm_1p", False)),
        position_embedding_type=str(pos),
        rotary_base=int(_get(args, "rotary_base", 10000)), rotary_percent=float(_get(args, "rotary_percent", 1.0)),
        rotary_interleaved=bool(args.get("rotary_interleaved", False)),
        rotary_seq_len_interpolation_factor=None if interp is None else float(interp),
        use_rope_scaling=bool(args.get("use_rope_scaling", False)),
        rope_scaling_factor=float(_get(args, "rope_scaling_factor", 8.0)),
        gated_linear_unit=swiglu, activation="silu" if swiglu else "gelu",
        add_bias_linear=bool(_get(args, "add_bias_linear", True)), add_qkv_bias=bool(args.get("add_qkv_bias", False)),
        share_embeddings_and_output_weights=not bool(args.get("untie_embeddings_and_output_weights", False)),
        qk_layernorm=bool(args.get("qk_layernorm", False)),
        apply_residual_connection_post_layernorm=bool(args.get("apply_residual_connection_post_layernorm", False)),
    )
    values.update(overrides)
    return ModelSpec(**values)


def spec_to_args(spec: ModelSpec) -> Dict[str, Any]:
    """The spec as Megatron-LM's ``args`` fields (what its ``check_checkpoint_args`` and model builders read)."""
    if spec.gated_linear_unit != (spec.activation == "silu"):
        raise ValueError(f"Megatron-LM's flags describe a GeLU MLP or a SwiGLU one (--swiglu), not "
                         f"activation={spec.activation} with gated_linear_unit={spec.gated_linear_unit}")
    gqa = spec.num_query_groups != spec.num_attention_heads
    return dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        group_query_attention=gqa, num_query_groups=spec.num_query_groups, kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size, seq_length=spec.seq_length,
        max_position_embeddings=spec.max_position_embeddings, padded_vocab_size=spec.padded_vocab_size,
        normalization=spec.normalization, norm_epsilon=spec.layernorm_epsilon,
        layernorm_epsilon=spec.layernorm_epsilon, apply_layernorm_1p=spec.layernorm_zero_centered_gamma,
        position_embedding_type=spec.position_embedding_type,
        add_position_embedding=spec.position_embedding_type == "learned_absolute",
        rotary_base=spec.rotary_base, rotary_percent=spec.rotary_percent,
        rotary_interleaved=spec.rotary_interleaved,
        rotary_seq_len_interpolation_factor=spec.rotary_seq_len_interpolation_factor,
        use_rope_scaling=spec.use_rope_scaling, rope_scaling_factor=spec.rope_scaling_factor,
        swiglu=spec.swiglu, add_bias_linear=spec.add_bias_linear, add_qkv_bias=spec.add_qkv_bias,
        untie_embeddings_and_output_weights=not spec.share_embeddings_and_output_weights,
        qk_layernorm=spec.qk_layernorm,
        apply_residual_connection_post_layernorm=spec.apply_residual_connection_post_layernorm,
    )
