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
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core.pipeline_parallel.actions import Action, ActionKind
from megatron.core.pipeline_parallel.executor import run_actions
from megatron.core.pipeline_parallel.microbatch import backward_step, forward_step
from megatron.core.pipeline_parallel.p2p import P2PCommunicator, pipeline_tensor_shape


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


# ---------------------------------------------------------------------------------------------------
# Pure schedule functions: (pp_size, pp_rank, num_microbatches, num_chunks, forward_only) -> [Action]
# ---------------------------------------------------------------------------------------------------


def check_schedule_arguments(pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int,
                             forward_only: bool = False) -> None:
    """Raise ``ValueError`` naming the offending quantity when a schedule cannot be built (a forward-only
    interleaved schedule takes any number of microbatches: ``compute_order``)."""
    if pp_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pp_size}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside [0, {pp_size})")
    check_num_microbatches(num_microbatches)
    if num_chunks < 1:
        raise ValueError(f"--virtual-pipeline-model-parallel-size (model chunks) must be >= 1, got {num_chunks}")
    if num_chunks > 1:
        if pp_size < 2:
            raise ValueError(
                f"an interleaved schedule ({num_chunks} model chunks) needs --pipeline-model-parallel-size >= 2, "
                f"got {pp_size}"
            )
        # Megatron's rule for the interleaved schedule: microbatches go through the virtual stages in
        # groups of pp_size, so the number of microbatches must be a multiple of the pipeline size.
        if num_microbatches % pp_size != 0 and not forward_only:
            raise ValueError(
                f"the interleaved schedule needs the number of microbatches ({num_microbatches}) to be a "
                f"multiple of --pipeline-model-parallel-size ({pp_size}); with --virtual-pipeline-model-"
                f"parallel-size {num_chunks} choose a global batch size giving a multiple of {pp_size} "
                "microbatches per data-parallel rank"
            )


def num_warmup_microbatches(pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1) -> int:
    """Forward passes a rank runs before its first backward.

    Non-interleaved 1F1B: ``min(pp_size - pp_rank - 1, M)``. Interleaved (counting forward passes of all
    chunks, ``M * num_chunks`` in all): ``min(2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * pp_size,
    M * num_chunks)``: the first stage must run its chunk-0 forwards of one whole group of ``pp_size``
    microbatches through every chunk before the gradient of the first one can come back.
    """
    if num_chunks == 1:
        return min(pp_size - pp_rank - 1, num_microbatches)
    total = num_microbatches * num_chunks
    return min(2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * pp_size, total)


def interleaved_step(k: int, pp_size: int, num_chunks: int, forward: bool) -> Tuple[int, int]:
    """(microbatch, chunk) of the ``k``-th forward (or backward) pass of a rank under interleaving.

    Microbatches go in groups of ``pp_size``: a group runs through chunk 0, then chunk 1, ..., each chunk
    taking the group's ``pp_size`` microbatches in order. Backward passes visit the chunks in reverse.
    """
    group, within = divmod(k, pp_size * num_chunks)
    chunk = within // pp_size
    if not forward:
        chunk = num_chunks - 1 - chunk
    return group * pp_size + within % pp_size, chunk


def compute_order(
    pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1, forward_only: bool = False
) -> List[Action]:
    """The FORWARD/BACKWARD actions of one rank in execution order (no communication).

    Warmup forwards, then one forward and one backward alternately (steady 1F1B), then the cooldown
    backwards. ``forward_only`` gives every forward and no backward; interleaved with a number of microbatches
    that is not a multiple of ``pp_size`` (one batch through the model, as generation and zero-shot scoring run
    it), each microbatch goes through every chunk before the next one starts.
    """
    check_schedule_arguments(pp_size, pp_rank, num_microbatches, num_chunks, forward_only)
    total = num_microbatches * num_chunks
    if num_chunks > 1 and num_microbatches % pp_size:  # forward only (checked above)
        return [Action(ActionKind.FORWARD, m, c) for m in range(num_microbatches) for c in range(num_chunks)]
    if num_chunks == 1:
        fwd = [Action(ActionKind.FORWARD, m, 0) for m in range(num_microbatches)]
        bwd = [Action(ActionKind.BACKWARD, m, 0) for m in range(num_microbatches)]
    else:
        fwd = [Action(ActionKind.FORWARD, *interleaved_step(k, pp_size, num_chunks, True)) for k in range(total)]
        bwd = [Action(ActionKind.BACKWARD, *interleaved_step(k, pp_size, num_chunks, False)) for k in range(total)]
    if forward_only:
        return fwd
    warmup = num_warmup_microbatches(pp_size, pp_rank, num_microbatches, num_chunks)
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[total - warmup:]


def _stage(pp_size: int, rank: int, chunk: int) -> int:
    return chunk * pp_size + rank


def _rank_chunk(pp_size: int, stage: int) -> Tuple[int, int]:
    chunk, rank = divmod(stage, pp_size)
    return rank, chunk


def _place_communication(
    pp_size: int, num_microbatches: int, num_chunks: int, forward_only: bool
) -> Tuple[List[List[Action]], List[List[Tuple[int, Action]]]]:
    """Interleave sends and receives with every rank's compute order.

    Returns every rank's action list and every rank's ``(tick, compute action)`` timeline.

    All ranks are played forward in lock step, one compute action per rank per tick, each rank computing
    as soon as its input has arrived. After tick ``t`` comes communication phase ``t``: a rank sends what
    it computed at tick ``t`` and, in the same phase, the receiving rank posts the matching receive.
    Because a send and its receive always belong to the same phase, and a rank's batch of phase ``t`` only
    waits on phase-``t`` batches of its neighbours, the real (unsynchronised) execution cannot deadlock
    even when ``batch_isend_irecv`` blocks until both sides have posted. At most one message goes from a
    rank to another per phase, so messages between two ranks are matched in order.
    """
    num_stages = pp_size * num_chunks
    orders = [compute_order(pp_size, r, num_microbatches, num_chunks, forward_only) for r in range(pp_size)]
    plans: List[List[Action]] = [[] for _ in range(pp_size)]
    timeline: List[List[Tuple[int, Action]]] = [[] for _ in range(pp_size)]
    tick = 0
    pos = [0] * pp_size
    arrived = set()  # (kind, microbatch, rank, chunk) of inputs received in earlier phases
    done = set()  # (kind, microbatch, rank, chunk) of computed actions
    while any(pos[r] < len(orders[r]) for r in range(pp_size)):
        computed = []
        for r in range(pp_size):
            if pos[r] == len(orders[r]):
                continue
            a = orders[r][pos[r]]
            stage = _stage(pp_size, r, a.chunk)
            if a.kind is ActionKind.FORWARD:
                ready = stage == 0 or (ActionKind.RECV_FORWARD, a.microbatch, r, a.chunk) in arrived
            else:
                ready = (ActionKind.FORWARD, a.microbatch, r, a.chunk) in done and (
                    stage == num_stages - 1 or (ActionKind.RECV_BACKWARD, a.microbatch, r, a.chunk) in arrived
                )
            if ready:
                computed.append((r, a))
        if not computed:
            raise RuntimeError(
                f"schedule stalls (pp={pp_size}, microbatches={num_microbatches}, chunks={num_chunks}): "
                f"ranks wait at {[str(orders[r][pos[r]]) if pos[r] < len(orders[r]) else '-' for r in range(pp_size)]}"
            )
        sends: List[List[Action]] = [[] for _ in range(pp_size)]
        recvs: List[List[Action]] = [[] for _ in range(pp_size)]
        for r, a in computed:
            plans[r].append(a)
            timeline[r].append((tick, a))
            pos[r] += 1
            done.add((a.kind, a.microbatch, r, a.chunk))
            stage = _stage(pp_size, r, a.chunk)
            if a.kind is ActionKind.FORWARD and stage < num_stages - 1:
                dst, dst_chunk = _rank_chunk(pp_size, stage + 1)
                sends[r].append(Action(ActionKind.SEND_FORWARD, a.microbatch, a.chunk, phase=tick))
                recvs[dst].append(Action(ActionKind.RECV_FORWARD, a.microbatch, dst_chunk, phase=tick))
            elif a.kind is ActionKind.BACKWARD and stage > 0:
                dst, dst_chunk = _rank_chunk(pp_size, stage - 1)
                sends[r].append(Action(ActionKind.SEND_BACKWARD, a.microbatch, a.chunk, phase=tick))
                recvs[dst].append(Action(ActionKind.RECV_BACKWARD, a.microbatch, dst_chunk, phase=tick))
        for r in range(pp_size):
            plans[r] += sends[r] + recvs[r]
            arrived.update((a.kind, a.microbatch, r, a.chunk) for a in recvs[r])
        tick += 1
    return plans, timeline


@functools.lru_cache(maxsize=64)
def _all_plans(pp_size: int, num_microbatches: int, num_chunks: int, forward_only: bool) -> Tuple[Tuple[Action, ...], ...]:
    plans, _ = _place_communication(pp_size, num_microbatches, num_chunks, forward_only)
    return tuple(tuple(p) for p in plans)


def schedule_timeline(
    pp_size: int, num_microbatches: int, num_chunks: int = 1, forward_only: bool = False
) -> List[List[Tuple[int, Action]]]:
    """For every rank, its compute actions with the tick at which the lock-step model runs them.

    Ticks assume every forward and backward takes one unit; they are what ``timeline.py`` draws.
    """
    check_schedule_arguments(pp_size, 0, num_microbatches, num_chunks, forward_only)
    return _place_communication(pp_size, num_microbatches, num_chunks, bool(forward_only))[1]


def build_schedule(
    pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1, forward_only: bool = False
) -> List[Action]:
    """The actions of pipeline rank ``pp_rank`` for one step: (interleaved when ``num_chunks > 1``) 1F1B."""
    check_schedule_arguments(pp_size, pp_rank, num_microbatches, num_chunks, forward_only)
    return list(_all_plans(pp_size, num_microbatches, num_chunks, bool(forward_only))[pp_rank])


def one_f_one_b_schedule(
    pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1, forward_only: bool = False
) -> List[Action]:
    """Non-interleaved 1F1B: ``min(pp_size - pp_rank - 1, M)`` warmup forwards, then 1F1B, then cooldown."""
    if num_chunks != 1:
        raise ValueError(f"the non-interleaved 1F1B schedule runs one model chunk per rank, got {num_chunks}")
    return build_schedule(pp_size, pp_rank, num_microbatches, 1, forward_only)


def interleaved_schedule(
    pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int, forward_only: bool = False
) -> List[Action]:
    """Interleaved 1F1B over ``num_chunks`` virtual stages per rank (chunk ``c`` of rank ``r`` is stage
    ``c * pp_size + r``); needs ``num_microbatches % pp_size == 0`` (Megatron's rule)."""
    if num_chunks < 2:
        raise ValueError(f"the interleaved schedule needs at least 2 model chunks per rank, got {num_chunks}")
    return build_schedule(pp_size, pp_rank, num_microbatches, num_chunks, forward_only)


# ---------------------------------------------------------------------------------------------------
# Entry points called by the trainer
# ---------------------------------------------------------------------------------------------------


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




def forward_backward_pipelining(
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
    no_sync_func: Any = None,
    finalize_grads_func: Optional[Callable] = None,
) -> List[Dict]:
    """1F1B across ``pstate.pp_size`` stages; interleaved 1F1B when ``model`` holds several chunks.

    ``model[c]`` is virtual stage ``c * pp_size + pp_rank``. Stages exchange ``[s, b, h]`` tensors
    (``[s/tp, b, h]`` with ``sequence_parallel``) of ``dtype``. ``data_iterator`` is a list with one
    iterator per chunk (each chunk's forward passes pull from it in microbatch order) or one iterator
    shared by all chunks (right only when at most one chunk of this rank reads data).
    """
    chunks = as_chunk_list(model)
    num_chunks = len(chunks)
    if pstate.vpp_size is not None and pstate.vpp_size != num_chunks:
        raise ValueError(
            f"--virtual-pipeline-model-parallel-size is {pstate.vpp_size} but the model has {num_chunks} chunk(s)"
        )
    actions = build_schedule(pstate.pp_size, pstate.pp_rank, num_microbatches, num_chunks, forward_only)
    shape = pipeline_tensor_shape(seq_length, micro_batch_size, hidden_size, pstate.tp_size, sequence_parallel)
    first_param = next(chunks[0].parameters(), None)
    device = first_param.device if first_param is not None else None  # receive where the model lives
    comm = P2PCommunicator(pstate, shape, dtype, device)
    stats = run_actions(
        actions,
        forward_step_func=forward_step_func,
        data_iterators=per_chunk(data_iterator, num_chunks, "data_iterator"),
        chunks=chunks,
        num_microbatches=num_microbatches,
        pstate=pstate,
        comm=comm,
        forward_only=forward_only,
        grad_scale_func=grad_scale_func,
        no_sync_func=no_sync_func,
    )
    if finalize_grads_func is not None and not forward_only:
        finalize_grads_func(chunks)
    return stats


def get_forward_backward_func(pstate: Any) -> Callable[..., List[Dict]]:
    """The schedule for this process's pipeline size: no pipelining for PP=1, (interleaved) 1F1B otherwise.

    The interleaved variant is chosen by the model itself: pass a list of ``vpp`` chunks.
    """
    if pstate.pp_size == 1:
        return forward_backward_no_pipelining
    return forward_backward_pipelining
