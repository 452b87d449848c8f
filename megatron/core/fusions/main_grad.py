"""Gradient-accumulation fusion for biases and LayerNorm parameters.

The weight-gradient GEMMs already add into the fp32 ``main_grad`` buffer of the data-parallel wrapper
(``linear.py``). The gradients of the small parameters (biases, LayerNorm gamma and beta) come out of
column-sum kernels that end in one short finishing kernel; with the fusion that kernel adds its fp32 sums to
``main_grad`` itself, instead of writing a 16-bit ``.grad`` that the wrapper's hook then adds (one more tiny
kernel per parameter and microbatch: ~200 per iteration of a 24-layer GPT, about 1 ms on an H200) after
rounding it to 16 bits.

A parameter takes part when its module flagged it (``param.grad_accumulation_fusion = True``, set from
``--gradient-accumulation-fusion``, the default), it requires grad and it carries an fp32 ``main_grad`` (it is
wrapped by ``DistributedDataParallel`` with fp32 gradient reduction). Like the fused weights it then gets no
``.grad``; ``grad_added_to_main_grad`` is set. Its post-accumulate-grad hook still fires, once per backward after
every use (autograd runs a leaf's accumulation node even when all its incoming gradients are None), so the
wrapper's bucket readiness under ``--overlap-grad-reduce`` is unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch


def main_grad_sink(param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``param.main_grad`` when a fused backward should add ``param``'s gradient into it, else None."""
    if param is None or not getattr(param, "grad_accumulation_fusion", False) or not param.requires_grad:
        return None
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None or main_grad.dtype != torch.float32 or torch.compiler.is_compiling():
        return None
    return main_grad


def mark_added_to_main_grad(param: torch.Tensor) -> None:
    """Record that ``param``'s gradient went straight into ``main_grad`` (Megatron's attribute; the wrapper's
    ``main_grad_is_zero`` mark, which lets the first FP8 weight-gradient GEMM write instead of add, is cleared)."""
    param.grad_added_to_main_grad = True
    param.main_grad_is_zero = False


def reduce_param_grad(param: Optional[torch.Tensor], reduce) -> Optional[torch.Tensor]:
    """The gradient of ``param`` from ``reduce(accumulate_into)``, a column-sum kernel call: with a sink, the
    kernel adds into ``param.main_grad`` and None is returned (autograd then leaves ``.grad`` alone); without
    one, ``reduce(None)``'s result is the gradient to return."""
    sink = main_grad_sink(param)
    grad = reduce(sink)
    if sink is None:
        return grad
    mark_added_to_main_grad(param)
    return None
