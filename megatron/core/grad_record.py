"""The per-parameter gradient record: how a parameter's gradient reaches its main-grad buffer.

The data-parallel wrapper (``megatron/core/distributed``) gives every trainable parameter a slice of one flat
buffer, ``main_grad`` (fp32 under mixed precision), in which the gradients of an iteration's microbatches are
summed before the data-parallel reduction. A gradient gets there in one of two ways:

- through autograd: the backward returns a ``.grad`` and the wrapper's post-accumulate-grad hook moves it in
  (:func:`add_grad`);
- fused (gradient-accumulation fusion): the weight-gradient GEMM stores the gradient into ``main_grad`` itself
  and the backward returns None for it, so no 16-bit ``.grad`` is ever materialised (``fusions/linear.py``,
  ``fusions/fp8.py``, ``fusions/mlp.py``, when their caller asks). Biases and LayerNorm parameters always take
  the autograd way.

Each parameter carries one :class:`GradRecord` (``param.grad_record``), attached by the wrapper with its buffer
slice; the slice is also ``param.main_grad``, Megatron's name for it, which the optimizer and the gradient clipping
read.

The zero rule. The wrapper clears the buffer at the start of every iteration and marks each record zero; while
``record.is_zero`` is set, the next gradient is *written* into the slice instead of added (a GEMM then never reads
the buffer, and the FP8 weight-gradient GEMM needs no separate add pass), and the mark is cleared. Every writer
goes through :func:`store_grad`, so this rule lives here only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(eq=False)
class GradRecord:
    """The gradient bookkeeping of one parameter.

    main_grad: the parameter's slice of the wrapper's buffer, shaped like the parameter (None until wrapped).
    is_zero: no gradient was stored into the slice yet in this iteration (the zero rule above).
    """

    main_grad: Optional[torch.Tensor] = None
    is_zero: bool = True


def record_of(param: Optional[torch.Tensor]) -> Optional[GradRecord]:
    """``param``'s record, or None (None, or a parameter no data-parallel wrapper gave one)."""
    return getattr(param, "grad_record", None)


def main_grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """``param``'s main-grad slice when a data-parallel wrapper gave it one, else None."""
    record = record_of(param)
    return None if record is None else record.main_grad


def attach_main_grad(param: torch.Tensor, main_grad: torch.Tensor) -> GradRecord:
    """Give ``param`` its buffer slice (the wrapper, once); the slice starts out marked zero."""
    if main_grad.shape != param.shape:
        raise ValueError(f"main_grad shape {tuple(main_grad.shape)} differs from the parameter's {tuple(param.shape)}")
    record = record_of(param)
    if record is None:
        record = GradRecord()
        param.grad_record = record
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
