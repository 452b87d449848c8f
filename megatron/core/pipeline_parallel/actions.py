"""The vocabulary of pipeline schedules: one ``Action`` per step a pipeline rank takes.

A schedule is the list of actions one rank performs in one training step. Compute actions run a model
chunk on one microbatch; communication actions move one tensor between neighbouring pipeline ranks:

=============== ================================================= ==================
kind            meaning                                           peer
=============== ================================================= ==================
RECV_FORWARD    receive the input activation of (microbatch, chunk) previous pipeline rank
FORWARD         run chunk ``chunk`` forward on ``microbatch``
SEND_FORWARD    send the output of (microbatch, chunk)            next pipeline rank
RECV_BACKWARD   receive the gradient of the output of (mb, chunk) next pipeline rank
BACKWARD        run the backward of (microbatch, chunk)
SEND_BACKWARD   send the gradient of the input of (mb, chunk)     previous pipeline rank
=============== ================================================= ==================

``chunk`` is always the chunk *on this rank* that the tensor belongs to: a SEND_FORWARD of chunk ``c`` on
rank ``r`` is matched by a RECV_FORWARD of chunk ``c`` on rank ``r + 1``, or of chunk ``c + 1`` on rank 0
when ``r`` is the last rank (the wrap-around of interleaved schedules). Neighbours wrap around: the
previous rank of rank 0 is the last rank.

Every communication action carries the *phase* the schedule placed it in (``steps`` below). Consecutive
communication actions of one phase form one *batch*: the executor posts them together with
``torch.distributed.batch_isend_irecv`` and waits for all of them before it posts the next batch or runs the
next compute action. A rank idle for a few ticks has consecutive batches of several phases; they stay apart,
because NCCL runs one batch as one group, and a group holding a send of phase ``t`` and a receive of phase
``t + 1`` can wait on the receive before the send goes out, while the neighbour waits on that send.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Sequence, Tuple, Union


class ActionKind(str, Enum):
    RECV_FORWARD = "RECV_FORWARD"
    FORWARD = "FORWARD"
    SEND_FORWARD = "SEND_FORWARD"
    RECV_BACKWARD = "RECV_BACKWARD"
    BACKWARD = "BACKWARD"
    SEND_BACKWARD = "SEND_BACKWARD"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD)


_SHORT = {
    ActionKind.RECV_FORWARD: "rF", ActionKind.FORWARD: "F", ActionKind.SEND_FORWARD: "sF",
    ActionKind.RECV_BACKWARD: "rB", ActionKind.BACKWARD: "B", ActionKind.SEND_BACKWARD: "sB",
}


@dataclass(frozen=True, repr=False)
class Action:
    """One step of a schedule: ``kind`` applied to ``microbatch`` on model chunk ``chunk`` of this rank.

    ``phase``: for communication actions, the communication phase of the schedule (-1 when unset); it only
    decides how actions are batched, so it takes no part in equality.
    """

    kind: ActionKind
    microbatch: int
    chunk: int = 0
    phase: int = field(default=-1, compare=False)

    def __str__(self) -> str:
        return f"{_SHORT[self.kind]}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    def __repr__(self) -> str:
        return f"Action({self.kind.value}, mb={self.microbatch}, chunk={self.chunk})"


def steps(actions: Sequence[Action]) -> List[Tuple[str, Union[Action, List[Action]]]]:
    """Split one rank's actions into ``("compute", action)`` and ``("batch", [communication actions])``.

    A batch is a run of consecutive communication actions of one phase.
    """
    out: List[Tuple[str, Union[Action, List[Action]]]] = []
    for a in actions:
        if a.kind.is_compute:
            out.append(("compute", a))
        elif out and out[-1][0] == "batch" and out[-1][1][-1].phase == a.phase:
            out[-1][1].append(a)
        else:
            out.append(("batch", [a]))
    return out
