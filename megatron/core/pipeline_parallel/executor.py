"""Run one rank's schedule (a list of ``Action``) on real model chunks.

The executor keeps four small tables keyed by ``(microbatch, chunk)``: received inputs, outputs (the loss
on the last stage), received output gradients and computed input gradients. Compute actions read and fill
them; each batch of ``actions.steps`` (consecutive communication actions of one phase) becomes one
``P2PCommunicator.exchange``. Once an output has been sent, its storage is freed (``deallocate_output``); its
autograd graph stays until the microbatch's backward.

Data-parallel gradient synchronisation: every chunk's ``no_sync`` context is entered before the first
action and left just before that chunk's last backward, so the data-parallel wrapper only reduces during
the last backward of each chunk (or in ``finalize_grads_func``, called once after the last backward).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.core.pipeline_parallel.actions import Action, ActionKind, steps
from megatron.core.pipeline_parallel.microbatch import (
    backward_step, deallocate_output, first_and_last_stage, forward_step,
)
from megatron.core.pipeline_parallel.p2p import P2PCommunicator

Key = Tuple[int, int]  # (microbatch, chunk)


class _GradSyncControl:
    """Holds the ``no_sync`` contexts: entered at the start, left before each chunk's last backward.

    ``no_sync_func`` is one context-manager factory (shared by all chunks: left before the last backward of
    the step) or a list with one factory per chunk (each left before its own chunk's last backward).
    """

    def __init__(self, no_sync_func, actions: Sequence[Action], num_chunks: int):
        backwards = [i for i, a in enumerate(actions) if a.kind is ActionKind.BACKWARD]
        self.stacks: List[contextlib.ExitStack] = []
        self.exit_at: Dict[int, int] = {}  # action index -> stack index to close before it
        if no_sync_func is None or not backwards:
            return
        if isinstance(no_sync_func, (list, tuple)):
            if len(no_sync_func) != num_chunks:
                raise ValueError(f"no_sync_func is a list of {len(no_sync_func)} but the model has {num_chunks} chunks")
            for c, factory in enumerate(no_sync_func):
                last = max((i for i in backwards if actions[i].chunk == c), default=None)
                if last is not None:
                    self._open(factory, last)
        else:
            self._open(no_sync_func, backwards[-1])

    def _open(self, factory: Callable, exit_before: int) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(factory())
        self.exit_at[exit_before] = len(self.stacks)
        self.stacks.append(stack)

    def before(self, index: int) -> None:
        if index in self.exit_at:
            self.stacks[self.exit_at.pop(index)].close()

    def close_all(self) -> None:
        for stack in reversed(self.stacks):
            stack.close()


def run_actions(
    actions: Sequence[Action],
    *,
    forward_step_func: Callable,
    data_iterators: List[Any],
    chunks: List[torch.nn.Module],
    num_microbatches: int,
    pstate: Any,
    comm: Optional[P2PCommunicator],
    forward_only: bool = False,
    grad_scale_func: Optional[Callable] = None,
    no_sync_func: Any = None,
) -> List[Dict]:
    """Execute ``actions`` for this pipeline rank; return the stats dicts (last stage) in microbatch order."""
    pp_size, pp_rank, num_chunks = pstate.pp_size, pstate.pp_rank, len(chunks)
    stages = [first_and_last_stage(pp_size, pp_rank, c, num_chunks) for c in range(num_chunks)]
    inputs: Dict[Key, Optional[torch.Tensor]] = {}
    outputs: Dict[Key, torch.Tensor] = {}
    output_grads: Dict[Key, torch.Tensor] = {}
    input_grads: Dict[Key, Optional[torch.Tensor]] = {}
    stats: List[Dict] = []
    sync = _GradSyncControl(None if forward_only else no_sync_func, actions, num_chunks)

    def communicate(batch: List[Action]) -> None:
        sends, send_keys, recv_from, recv_actions = [], [], [], []
        for a in batch:
            key = (a.microbatch, a.chunk)
            if a.kind is ActionKind.SEND_FORWARD:
                sends.append((outputs[key], pstate.next_pp_rank))
                send_keys.append((a.kind, key))
            elif a.kind is ActionKind.SEND_BACKWARD:
                grad = input_grads.pop(key)
                if grad is None:
                    raise RuntimeError(
                        f"microbatch {a.microbatch}, chunk {a.chunk}: the stage input got no gradient; does the "
                        "chunk use the tensor given to set_input_tensor?"
                    )
                sends.append((grad, pstate.prev_pp_rank))
                send_keys.append((a.kind, key))
            elif a.kind is ActionKind.RECV_FORWARD:
                recv_from.append(pstate.prev_pp_rank)
                recv_actions.append(a)
            else:
                recv_from.append(pstate.next_pp_rank)
                recv_actions.append(a)
        received = comm.exchange(sends, recv_from)
        for a, tensor in zip(recv_actions, received):
            key = (a.microbatch, a.chunk)
            if a.kind is ActionKind.RECV_FORWARD:
                inputs[key] = tensor.requires_grad_(not forward_only)  # its .grad goes back upstream
            else:
                output_grads[key] = tensor
        for kind, key in send_keys:
            if kind is ActionKind.SEND_FORWARD:
                if forward_only:
                    del outputs[key]
                else:
                    deallocate_output(outputs[key])  # the graph stays for the backward

    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    try:
        with grad_ctx:
            i = 0  # index in ``actions`` of the step's first action
            for step, what in steps(actions):
                if step == "batch":
                    communicate(what)
                    i += len(what)
                    continue
                a = what
                sync.before(i)
                key = (a.microbatch, a.chunk)
                is_first, is_last = stages[a.chunk]
                if a.kind is ActionKind.FORWARD:
                    input_tensor = None if is_first else inputs.pop(key)
                    output = forward_step(
                        forward_step_func, data_iterators[a.chunk], chunks[a.chunk], num_microbatches,
                        input_tensor, is_last_stage=is_last, set_input=not is_first, stats=stats,
                    )
                    if not forward_only:
                        inputs[key] = input_tensor
                        outputs[key] = output
                    elif not is_last:
                        outputs[key] = output.detach()
                else:
                    grad = backward_step(
                        inputs.pop(key), outputs.pop(key), None if is_last else output_grads.pop(key),
                        grad_scale_func,
                    )
                    if not is_first:
                        input_grads[key] = grad
                i += 1
    finally:
        sync.close_all()
    leftovers = [name for name, table in (("inputs", inputs), ("outputs", outputs),
                                          ("output grads", output_grads), ("input grads", input_grads)) if table]
    if leftovers:
        raise RuntimeError(f"schedule left unconsumed {', '.join(leftovers)}: the action list is inconsistent")
    return stats
