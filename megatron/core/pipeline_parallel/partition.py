"""Which decoder layers each pipeline stage (and virtual chunk) holds.

``layers_for_stage`` returns ``(offset, count)``: the stage holds global layers ``offset .. offset+count-1``.

* Even split: every rank gets ``num_layers / pp`` layers (``--num-layers`` must be divisible).
* Uneven split: ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` fix the first /
  last rank's count; the remaining layers are split evenly over the other ranks.
* Interleaving (``vpp_size`` chunks per rank): each rank's layers are cut into ``vpp_size`` equal chunks and the
  chunks are ordered as virtual stages ``v * pp + r`` — so, with an even split, chunk ``v`` of rank ``r`` starts
  at layer ``(v * pp + r) * layers_per_virtual_stage`` (Megatron's assignment).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple


def layers_per_rank(
    num_layers: int,
    pp_size: int,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> List[int]:
    """Number of decoder layers held by each pipeline rank (all its chunks together)."""
    if num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
    if pp_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pp_size}")
    fixed = {}
    for flag, value, rank in (("--decoder-first-pipeline-num-layers", first_stage_layers, 0),
                              ("--decoder-last-pipeline-num-layers", last_stage_layers, pp_size - 1)):
        if value is None:
            continue
        if pp_size == 1:
            raise ValueError(f"{flag} needs --pipeline-model-parallel-size > 1, got {pp_size}")
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
        fixed[rank] = value
    if not fixed:
        if num_layers % pp_size != 0:
            raise ValueError(
                f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size ({pp_size}); "
                "for an uneven split use --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
            )
        return [num_layers // pp_size] * pp_size
    rest = num_layers - sum(fixed.values())
    others = pp_size - len(fixed)
    if rest < 0 or (others == 0 and rest != 0):
        raise ValueError(
            f"--decoder-first-pipeline-num-layers ({first_stage_layers}) and --decoder-last-pipeline-num-layers "
            f"({last_stage_layers}) leave {rest} of --num-layers ({num_layers}) for {others} other stage(s)"
        )
    if others and (rest == 0 or rest % others != 0):
        raise ValueError(
            f"the {rest} layers left by --decoder-first/last-pipeline-num-layers must split evenly (and non-empty) "
            f"over the {others} other pipeline stage(s) of --pipeline-model-parallel-size {pp_size}"
        )
    return [fixed.get(r, rest // others if others else 0) for r in range(pp_size)]


def layers_for_stage(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    vpp_size: Optional[int] = None,
    vpp_rank: int = 0,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> Tuple[int, int]:
    """``(offset, count)`` of the decoder layers of chunk ``vpp_rank`` on pipeline rank ``pp_rank``."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside [0, {pp_size})")
    vpp = 1 if vpp_size is None else vpp_size
    if vpp < 1:
        raise ValueError(f"--virtual-pipeline-model-parallel-size must be >= 1, got {vpp_size}")
    if not 0 <= vpp_rank < vpp:
        raise ValueError(f"virtual pipeline rank {vpp_rank} is outside [0, {vpp})")
    counts = layers_per_rank(num_layers, pp_size, first_stage_layers, last_stage_layers)
    for r, n in enumerate(counts):
        if n % vpp != 0:
            raise ValueError(
                f"pipeline rank {r} holds {n} layers (--num-layers {num_layers}, --pipeline-model-parallel-size "
                f"{pp_size}), not divisible by --virtual-pipeline-model-parallel-size ({vpp})"
            )
    per_chunk = [n // vpp for n in counts]  # layers of one chunk on each rank
    # virtual stages in order: (chunk 0 of ranks 0..pp-1), (chunk 1 of ranks 0..pp-1), ...
    offset = vpp_rank * num_layers // vpp + sum(per_chunk[:pp_rank])
    return offset, per_chunk[pp_rank]


class StageChunk(NamedTuple):
    """One model chunk of this pipeline rank: its decoder/encoder layers and whether it holds the first stage's
    inputs (``pre_process``) and the last stage's outputs (``post_process``)."""

    pre_process: bool
    post_process: bool
    layer_offset: int
    num_layers: int


def stage_chunks(num_layers: int, pstate, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None) -> List[StageChunk]:
    """The model chunks (one per virtual pipeline stage) that pipeline rank ``pstate.pp_rank`` builds."""
    vpp = pstate.vpp_size or 1
    chunks = []
    for v in range(vpp):
        offset, count = layers_for_stage(num_layers, pstate.pp_size, pstate.pp_rank, vpp_size=pstate.vpp_size,
                                         vpp_rank=v, first_stage_layers=first_stage_layers,
                                         last_stage_layers=last_stage_layers)
        chunks.append(StageChunk(pstate.is_pipeline_first_stage and v == 0,
                                 pstate.is_pipeline_last_stage and v == vpp - 1, offset, count))
    return chunks
