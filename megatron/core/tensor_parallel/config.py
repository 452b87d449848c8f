"""What the tensor-parallel layers need to know about the model: dtype, sequence parallelism, the GEMM options."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass(frozen=True, kw_only=True)
class LinearConfig:
    """The linear layers' options; ``TransformerConfig`` inherits them (keyword-only, so they may follow the
    model description's required fields)."""

    params_dtype: torch.dtype = torch.float32  # dtype of the parameters (bf16/fp16 under mixed precision)
    sequence_parallel: bool = False
    # the weight-gradient GEMM accumulates straight into the fp32 main_grad buffer (CUDA; fusions/linear.py)
    gradient_accumulation_fusion: bool = True
    # FP8 GEMMs: None or one of fusions.fp8.FP8_FORMATS, with its scaling options: "tensorwise" (each operand
    # scaled by its own current amax) or "delayed" (by its amax history; fusions/fp8.py)
    fp8: Optional[str] = None
    fp8_margin: int = 0
    fp8_recipe: str = "tensorwise"
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"

    @classmethod
    def of(cls, config) -> "LinearConfig":
        """``config`` itself when it is a LinearConfig, else its same-named attributes (a model's configuration
        holds them all)."""
        if isinstance(config, cls):
            return config
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})
