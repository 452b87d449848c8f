"""Typed configuration of the transformer: every layer reads only this section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.core.fusions.fp8 import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES
from megatron.core.model_spec import ATTENTION_MASK_TYPES, ModelSpec  # noqa: F401  (re-exported)
from megatron.core.tensor_parallel.config import LinearConfig


ATTENTION_BACKENDS = ("sdpa", "flash", "cudnn", "unfused")


@dataclass(frozen=True)
class TransformerConfig(ModelSpec, LinearConfig):
    """The model's description (``ModelSpec``, whose fields it inherits) plus the runtime switches of its layers:
    dropout, initialisation, recomputation, kernels, and the linear layers' dtype, sequence parallelism and FP8
    (``LinearConfig``, whose fields it inherits). ``.spec`` is the plain spec."""

    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ValueError(f"--recompute-granularity must be selective or full, got {self.recompute_granularity}")
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {self.recompute_num_layers}")
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        unknown = sorted(set(self.recompute_modules) - {"core_attn", "mlp_act"})
        if unknown:
            raise ValueError(f"--recompute-modules accepts core_attn and mlp_act, got {', '.join(unknown)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend}")
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

    @classmethod
    def from_spec(cls, spec: ModelSpec, **runtime) -> "TransformerConfig":
        """The spec's fields plus the runtime switches ``runtime`` (TransformerConfig's own field names)."""
        return cls(**spec.spec.to_dict(), **runtime)

    def check_tensor_parallel(self, tp_size: int) -> None:
        """The model's constraints (``ModelSpec``) and sequence parallelism's."""
        super().check_tensor_parallel(tp_size)
        if self.sequence_parallel and self.seq_length % tp_size:
            raise ValueError(f"--seq-length ({self.seq_length}) must be divisible by --tensor-model-parallel-size "
                             f"({tp_size}) under --sequence-parallel")

    def recomputes(self, module: str) -> bool:
        """True when selective recomputation covers ``module`` ("core_attn" or "mlp_act")."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules
