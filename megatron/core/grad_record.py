"""The per-parameter gradient record: how a parameter's gradient reaches its main-grad buffer.

The data-parallel wrapper (``megatron/core/distributed``) gives every trainable parameter a slice of one flat
buffer, ``main_grad`` (fp32 under mixed precision), in which the gradients of an iteration's microbatches are
summed before the data-parallel reduction. A gradient gets there in one of two ways:

- through autograd: the backward returns a ``.grad`` and the wrapper's post-accumulate-grad hook moves it in
  (:func:`add_grad`);
- fused (gradient-accumulation fusion): the backward stores the gradient into ``main_grad`` itself and returns
  None, so no 16-bit ``.grad`` is ever materialised. The weight-gradient GEMMs do this when their caller asks
  (``fusions/linear.py``, ``fusions/fp8.py``, ``fusions/mlp.py``); the small parameters (biases, LayerNorm gamma
  and beta) do it when their layer declared them a gradient sink (:func:`declare_grad_sink`), in the column-sum
  kernels that finish their gradients (``fusions/ops.py``, the Triton kernels).

Each parameter carries one :class:`GradRecord` (``param.grad_record``), attached once: by the layer that creates
the parameter when it is a gradient sink, otherwise by the wrapper. The wrapper fills in the buffer slice; the
slice is also ``param.main_grad``, Megatron's name for it, which the optimizer and the gradient clipping read.

The zero rule. While ``record.is_zero`` is set the slice counts as zero, whatever it holds: the next gradient
is *written* into it, not added, and the mark is cleared. Every writer goes through :func:`store_grad`, so this
rule lives here only. It lets the wrapper skip zeroing the buffer between iterations
(``DDPConfig.lazy_grad_zero``): a slice no backward wrote in an iteration is zeroed just before the reduction
(``DistributedDataParallel.settle_unwritten_grads``).

Switch: ``SMALL_PARAM_GRAD_SINK`` (read at every backward, so a benchmark can compare both settings in one
process) turns the small-parameter sinks off; their gradients then come back as ``.grad`` through the hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

SMALL_PARAM_GRAD_SINK = True


@dataclass(eq=False)
class GradRecord:
    """The gradient bookkeeping of one parameter.

    sink: the parameter's fused backward kernels may store its gradient into ``main_grad`` (a bias or LayerNorm
        parameter of a layer built with gradient-accumulation fusion; weights are decided by the GEMM's caller).
    main_grad: the parameter's slice of the wrapper's buffer, shaped like the parameter (None until wrapped).
    is_zero: the slice counts as zero for this iteration (the zero rule above).
    """

    sink: bool = False
    main_grad: Optional[torch.Tensor] = None
    is_zero: bool = True


def record_of(param: Optional[torch.Tensor]) -> Optional[GradRecord]:
    """``param``'s record, or None (None, or a parameter that neither a layer nor the wrapper gave one)."""
    return getattr(param, "grad_record", None)


def main_grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """``param``'s main-grad slice when a data-parallel wrapper gave it one, else None."""
    record = record_of(param)
    return None if record is None else record.main_grad


def _attach(param: torch.Tensor) -> GradRecord:
    record = record_of(param)
    if record is None:
        record = GradRecord()
        param.grad_record = record
    return record


def declare_grad_sink(param: torch.Tensor, enabled: bool) -> None:
    """Called by a layer for a bias or LayerNorm parameter: with ``enabled`` (``--gradient-accumulation-fusion``)
    its fused backward kernels store its gradient straight into ``main_grad``."""
    _attach(param).sink = bool(enabled)


def attach_main_grad(param: torch.Tensor, main_grad: torch.Tensor) -> GradRecord:
    """Give ``param`` its buffer slice (the wrapper, once); the slice starts out marked zero."""
    if main_grad.shape != param.shape:
        raise ValueError(f"main_grad shape {tuple(main_grad.shape)} differs from the parameter's {tuple(param.shape)}")
    record = _attach(param)
    record.main_grad, record.is_zero = main_grad, True
    param.main_grad = main_grad
    return record


def fused_target(param: Optional[torch.Tensor]) -> Optional[GradRecord]:
    """The record of a parameter whose backward can store its gradient into an fp32 ``main_grad`` itself, or
    None: no record or buffer, a non-fp32 buffer (16-bit reduction: the hook adds), frozen, or while
    ``torch.compile`` traces."""
    record = record_of(param)
    if (record is None or record.main_grad is None or record.main_grad.dtype != torch.float32
            or not param.requires_grad or torch.compiler.is_compiling()):
        return None
    return record


def grad_sink(param: Optional[torch.Tensor]) -> Optional[GradRecord]:
    """``fused_target`` for a small parameter that its layer declared a sink (and ``SMALL_PARAM_GRAD_SINK``)."""
    record = fused_target(param)
    return record if record is not None and record.sink and SMALL_PARAM_GRAD_SINK else None


def store_grad(param: torch.Tensor, store: Callable[[torch.Tensor, bool], None]) -> None:
    """Put a gradient of ``param`` into its ``main_grad``: ``store(main_grad, accumulate)`` must add its result to
    ``main_grad`` when ``accumulate`` and overwrite it otherwise (the slice is marked zero). The one place that
    reads and clears the zero mark."""
    record = param.grad_record
    store(record.main_grad, not record.is_zero)
    record.is_zero = False


def add_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``main_grad += grad`` under the zero rule (the wrapper's hook, for a gradient autograd returned)."""
    store_grad(param, lambda main_grad, accumulate: main_grad.add_(grad) if accumulate else main_grad.copy_(grad))


def sink_output(param: Optional[torch.Tensor], n: int, dtype: torch.dtype,
                device: torch.device) -> Tuple[torch.Tensor, bool]:
    """``(out, accumulate)`` for a kernel that finishes the gradient of the small parameter ``param``: with a sink,
    its ``main_grad`` (``accumulate`` False while the slice is marked zero: the kernel overwrites it); without
    one, a new ``[n]`` tensor of ``dtype``. Pair with ``sink_result`` once the kernel is launched (the
    two-step form of ``store_grad``, for a launch that finishes two parameters' gradients at once)."""
    record = grad_sink(param)
    if record is None:
        return torch.empty(n, dtype=dtype, device=device), False
    return record.main_grad.view(-1), not record.is_zero


def sink_result(param: Optional[torch.Tensor], out: torch.Tensor) -> Optional[torch.Tensor]:
    """What the backward returns for ``param`` after a ``sink_output`` launch: None when the gradient went into
    its ``main_grad`` (whose zero mark is then cleared), else ``out``."""
    record = grad_sink(param)
    if record is None:
        return out
    record.is_zero = False
    return None


def reduce_into_sink(param: Optional[torch.Tensor], reduce) -> Optional[torch.Tensor]:
    """The gradient of a small parameter from ``reduce(out, accumulate)``, a column-sum call that stores into
    ``out`` (adding when ``accumulate``) or, given ``out=None``, returns a new tensor. With a sink the sums go
    into ``main_grad`` under the zero rule and None is returned (autograd then leaves ``.grad`` alone)."""
    if grad_sink(param) is None:
        return reduce(None, False)
    store_grad(param, lambda main_grad, accumulate: reduce(main_grad.view(-1), accumulate))
    return None
