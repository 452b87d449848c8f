"""Forward/backward schedules over microbatches.

``get_forward_backward_func(pstate)`` picks the function the trainer calls once per iteration:

* pipeline size 1: ``forward_backward_no_pipelining`` — gradient accumulation over the microbatches;
* pipeline size > 1: ``forward_backward_pipelining`` — 1F1B, interleaved when the model has several chunks.

All of them share one signature (see ``docs/design.md``)::

    forward_backward(forward_step_func, data_iterator, model, num_microbatches, seq_length,
                     micro_batch_size, hidden_size, dtype, pstate, sequence_parallel=False,
                     forward_only=False, grad_scale_func=None, no_sync_func=None,
                     finalize_grads_func=None) -> list[dict]

and the same rules: the loss of each microbatch is divided by ``num_microbatches``; ``grad_scale_func(loss)``
is applied before backward; every backward but the last of each chunk runs under ``no_sync_func()`` so that
data-parallel gradient reduction happens once per step; ``finalize_grads_func(model)`` runs once after the
last backward; the stats dicts returned by ``loss_func`` come back in microbatch order on the last stage
(``[]`` elsewhere). With ``forward_only`` everything runs under ``torch.no_grad()`` and nothing is
differentiated or finalised.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from megatron.core.pipeline_parallel.microbatch import backward_step, forward_step


def as_chunk_list(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> List[torch.nn.Module]:
    """The model as a list of chunks (a single module becomes a list of one)."""
    if isinstance(model, torch.nn.Module):
        return [model]
    chunks = list(model)
    if not chunks:
        raise ValueError("model must be a module or a non-empty list of model chunks")
    return chunks


def per_chunk(value: Any, num_chunks: int, what: str) -> List[Any]:
    """Spread ``value`` over the chunks: a list must have one entry per chunk, anything else is shared."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_chunks:
            raise ValueError(f"{what} is a list of {len(value)} entries but the model has {num_chunks} chunk(s)")
        return list(value)
    return [value] * num_chunks


def check_num_microbatches(num_microbatches: int) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")


def forward_backward_no_pipelining(
    forward_step_func: Callable,
    data_iterator: Any,
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    pstate: Any,
    sequence_parallel: bool = False,
    forward_only: bool = False,
    grad_scale_func: Optional[Callable] = None,
    no_sync_func: Optional[Callable] = None,
    finalize_grads_func: Optional[Callable] = None,
) -> List[Dict]:
    """Gradient accumulation on one pipeline stage: forward and backward of each microbatch in turn.

    Every microbatch but the last runs (forward and backward) under ``no_sync_func()``, so a data-parallel
    wrapper reduces gradients only during the last backward / in ``finalize_grads_func``. The shape
    arguments are unused here (nothing is communicated); they keep the signature of the pipelined schedule.
    """
    check_num_microbatches(num_microbatches)
    chunks = as_chunk_list(model)
    if len(chunks) != 1:
        raise ValueError(
            f"without pipeline parallelism the model must be a single chunk, got {len(chunks)} chunks "
            "(virtual pipeline stages need --pipeline-model-parallel-size > 1)"
        )
    chunk = chunks[0]
    data_iterator = per_chunk(data_iterator, 1, "data_iterator")[0]
    no_sync = per_chunk(no_sync_func, 1, "no_sync_func")[0] or contextlib.nullcontext

    stats: List[Dict] = []
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_ctx:
        for mb in range(num_microbatches):
            last = mb == num_microbatches - 1
            sync_ctx = contextlib.nullcontext() if (last or forward_only) else no_sync()
            with sync_ctx:
                loss = forward_step(
                    forward_step_func, data_iterator, chunk, num_microbatches, None,
                    is_last_stage=True, set_input=False, stats=stats,
                )
                if not forward_only:
                    backward_step(None, loss, None, grad_scale_func)
    if finalize_grads_func is not None and not forward_only:
        finalize_grads_func(chunks)
    return stats


def get_forward_backward_func(pstate: Any) -> Callable[..., List[Dict]]:
    """The schedule for this process's pipeline size: no pipelining for PP=1, (interleaved) 1F1B otherwise."""
    if pstate.pp_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipelined schedules land in the next commit")
