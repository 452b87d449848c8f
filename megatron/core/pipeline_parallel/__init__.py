"""Pipeline parallelism: schedules as pure functions of the pipeline layout, an executor, batched p2p.

``get_forward_backward_func(pstate)`` is what the trainer calls; ``build_schedule`` gives the action list
of one rank; ``layers_for_stage`` says which decoder layers a stage (or virtual chunk) holds.
"""

from megatron.core.pipeline_parallel.actions import Action, ActionKind
from megatron.core.pipeline_parallel.partition import layers_for_stage, layers_per_rank
from megatron.core.pipeline_parallel.schedules import (
    build_schedule,
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    get_forward_backward_func,
    interleaved_schedule,
    one_f_one_b_schedule,
)

__all__ = [
    "Action", "ActionKind", "build_schedule", "forward_backward_no_pipelining", "forward_backward_pipelining",
    "get_forward_backward_func", "interleaved_schedule", "layers_for_stage", "layers_per_rank",
    "one_f_one_b_schedule",
]
