"""Linear layer with gradient-accumulation fusion: the weight gradient GEMM accumulates straight into the fp32
``weight.main_grad`` buffer of the data-parallel wrapper.

Without it, backward writes a bf16 ``weight.grad`` and the DDP hook then runs ``main_grad += grad`` (one more
pass over every weight: read 2 + 4 bytes, write 4, per parameter and microbatch, plus the bf16 gradient at the
memory peak). With it, cuBLAS reads and writes the fp32 buffer in the GEMM's epilogue
(``torch.addmm(main_grad, dy^T, x, out_dtype=float32, out=main_grad)``, or with ``beta=0`` a write that never
reads the buffer while it is marked zero: ``megatron/core/grad_record.py``) and the weight gets no ``.grad``.
The weight's post-accumulate-grad hook still fires, once per backward after every use of the weight (autograd
runs a leaf's accumulation node even when the incoming gradient is None), so the wrapper's bucket readiness
under ``--overlap-grad-reduce`` sees it (``tests/unit/distributed/test_dp_parity.py``).

``linear_with_grad_accumulation_fusion(x, weight, bias)`` equals ``F.linear(x, weight, bias)`` in value and in the
gradients of ``x`` and ``bias``; it falls back to plain ``F.linear`` when the weight has no fp32 ``main_grad``,
off CUDA, and while ``torch.compile`` traces.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions.ops import bias_grad
from megatron.core.grad_record import fused_target, store_grad


def accumulate_wgrad(weight: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor) -> None:
    """``weight.main_grad += dy2^T @ x2`` with fp32 accumulation and output (one GEMM when the build supports
    out_dtype), or ``=`` while the slice is marked zero (``grad_record.store_grad``: the GEMM then writes and
    never reads the buffer)."""

    def store(main_grad: torch.Tensor, accumulate: bool) -> None:
        try:
            torch.addmm(main_grad, dy2.t(), x2, beta=1.0 if accumulate else 0.0, out_dtype=torch.float32,
                        out=main_grad)
        except (RuntimeError, TypeError):  # builds without the mixed-dtype addmm: GEMM, then add or copy
            g = torch.mm(dy2.t(), x2).float()
            if accumulate:
                main_grad.add_(g)
            else:
                main_grad.copy_(g)

    store_grad(weight, store)


class LinearWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # the Parameter itself, to reach .main_grad in backward
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None  # [.., in]
        dy2 = dy.reshape(-1, dy.shape[-1])  # [tokens, out]
        accumulate_wgrad(ctx.weight, dy2, x.reshape(-1, x.shape[-1]))
        dbias = bias_grad(dy2) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, dbias


def linear_with_grad_accumulation_fusion(x: torch.Tensor, weight: torch.Tensor,
                                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) whose weight gradient is added into ``weight.main_grad`` (fp32) by the GEMM."""
    if not x.is_cuda or fused_target(weight) is None:
        return F.linear(x, weight, bias)
    return LinearWithGradAccumulation.apply(x, weight, bias)
