"""Element-wise kernels of the transformer, each with a plain PyTorch reference it must match.

The model calls only the public functions below; each picks a fused implementation when one applies (CUDA,
Triton importable and ``use_fused=True``) and falls back to the reference otherwise.
"""

from megatron.core.fusions.cross_entropy import fused_vocab_cross_entropy  # noqa: F401
from megatron.core.fusions.ops import (apply_rotary_pos_emb, bias_dropout_add, bias_gelu, bias_swiglu,  # noqa: F401
                                       layer_norm, layer_norm_with_residual, rms_norm, rms_norm_with_residual,
                                       scaled_masked_softmax, swiglu)
from megatron.core.fusions.linear import linear_with_grad_accumulation_fusion  # noqa: F401
from megatron.core.fusions.mlp import bias_gelu_linear  # noqa: F401
