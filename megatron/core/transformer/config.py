"""Typed configuration of the transformer: every layer reads only this section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.core.fusions.fp8 import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES


ATTENTION_BACKENDS = ("sdpa", "flash", "cudnn", "unfused")
ATTENTION_MASK_TYPES = ("causal", "padding")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
ACTIVATIONS = ("gelu", "silu")


@dataclass
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size
    seq_length: int = 1024
    max_position_embeddings: Optional[int] = None  # default seq_length
    padded_vocab_size: int = 0  # set from the tokenizer by the trainer
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    init_method_std: float = 0.02
    params_dtype: torch.dtype = torch.float32  # dtype of the model's parameters (bf16/fp16 under mixed precision)
    share_embeddings_and_output_weights: bool = True
    sequence_parallel: bool = False
    # activation recomputation: None | "selective" | "full"; method "uniform" | "block"
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    # what "selective" recomputes: "core_attn" (softmax(QK^T)V) and/or "mlp_act" (the MLP's GeLU output)
    recompute_modules: Tuple[str, ...] = ("core_attn", "mlp_act")
    # attention kernels: "sdpa" (torch scaled_dot_product_attention, PyTorch picks the kernel), "flash" or "cudnn"
    # (SDPA restricted to that kernel; CUDA only), or "unfused" (explicit scale-mask-softmax)
    attention_backend: str = "sdpa"
    use_fused_kernels: bool = True  # fused element-wise kernels on CUDA; plain PyTorch elsewhere
    # each fusion alone (--no-bias-gelu-fusion, --no-bias-dropout-fusion, --no-persist-layer-norm); a kernel is
    # fused when use_fused_kernels and its own switch are both on
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    layernorm_fusion: bool = True
    # weight-gradient GEMMs accumulate straight into the fp32 main_grad buffer (CUDA; a no-op elsewhere)
    gradient_accumulation_fusion: bool = True
    # FP8 GEMMs in the transformer layers' linears: None or one of fp8.FP8_FORMATS (megatron/core/fusions/fp8.py)
    fp8: Optional[str] = None
    fp8_margin: int = 0
    # "tensorwise" (each operand scaled by its own current amax) or "delayed" (by its amax history; fp8.py)
    fp8_recipe: str = "tensorwise"
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    # "causal" (GPT: each position sees itself and the past) or "padding" (BERT: bidirectional; the layers take
    # an optional boolean key-padding mask [b, 1, 1, s], True = masked out)
    attention_mask_type: str = "causal"
    # the original BERT order: the residual branch starts from the LayerNorm's output instead of its input
    # (Megatron-LM's --apply-residual-connection-post-layernorm; docs/bert.md shows it is the post-LN BERT)
    apply_residual_connection_post_layernorm: bool = False
    # ---- model options of the Llama family (Megatron-Core's names and defaults) ----
    num_query_groups: Optional[int] = None  # key/value heads (grouped-query attention); None: one per query head
    kv_channels: Optional[int] = None  # channels per attention head; None: hidden_size // num_attention_heads
    normalization: str = "LayerNorm"  # "LayerNorm" or "RMSNorm"
    position_embedding_type: str = "learned_absolute"  # "learned_absolute", "rope" or "none"
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # fraction of each head's channels that is rotated
    rotary_interleaved: bool = False  # rotate channel pairs (2i, 2i+1) instead of (i, i + d/2)
    rotary_seq_len_interpolation_factor: Optional[float] = None  # positions are divided by it
    use_rope_scaling: bool = False  # Llama 3.1's frequency scaling
    rope_scaling_factor: float = 8.0
    gated_linear_unit: bool = False  # the MLP's first linear is [gate; up] and the activation gates the up half
    activation: str = "gelu"  # "gelu" or "silu" (SwiGLU with gated_linear_unit)
    add_bias_linear: bool = True  # biases on every linear layer
    add_qkv_bias: bool = False  # a bias on the QKV linear alone (with add_bias_linear False)
    qk_layernorm: bool = False  # normalise each head's queries and keys (the model's normalization)

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                    f"({self.num_attention_heads})"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                             f"--num-query-groups ({self.num_query_groups})")
        for name, value, allowed in (("--normalization", self.normalization, NORMALIZATIONS),
                                     ("--position-embedding-type", self.position_embedding_type,
                                      POSITION_EMBEDDING_TYPES),
                                     ("--activation", self.activation, ACTIVATIONS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings})"
            )
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ValueError(f"--recompute-granularity must be selective or full, got {self.recompute_granularity}")
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {self.recompute_num_layers}")
        self.recompute_modules = tuple(self.recompute_modules)
        unknown = sorted(set(self.recompute_modules) - {"core_attn", "mlp_act"})
        if unknown:
            raise ValueError(f"--recompute-modules accepts core_attn and mlp_act, got {', '.join(unknown)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend}")
        if self.attention_mask_type not in ATTENTION_MASK_TYPES:
            raise ValueError(f"attention mask type must be one of {', '.join(ATTENTION_MASK_TYPES)}, "
                             f"got {self.attention_mask_type}")
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ValueError(f"--fp8-format must be one of {', '.join(FP8_FORMATS)}, got {self.fp8}")
        if self.fp8_margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.fp8_margin}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe}")
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.fp8_amax_history_len}")
        if self.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo must be one of {', '.join(AMAX_COMPUTE_ALGOS)}, "
                             f"got {self.fp8_amax_compute_algo}")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """The shape constraints of splitting this model over ``tp_size`` tensor-parallel ranks."""
        if self.num_attention_heads % tp_size:
            raise ValueError(f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp_size})")
        if self.num_query_groups % tp_size:
            raise ValueError(f"--num-query-groups ({self.num_query_groups}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp_size})")
        if self.ffn_hidden_size % tp_size:
            raise ValueError(f"--ffn-hidden-size ({self.ffn_hidden_size}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp_size})")
        if self.sequence_parallel and self.seq_length % tp_size:
            raise ValueError(f"--seq-length ({self.seq_length}) must be divisible by --tensor-model-parallel-size "
                             f"({tp_size}) under --sequence-parallel")

    def recomputes(self, module: str) -> bool:
        """True when selective recomputation covers ``module`` ("core_attn" or "mlp_act")."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules
