"""Text timelines of the pipeline schedules, drawn from the schedule functions themselves.

    python -m megatron.core.pipeline_parallel.timeline --pp 4 --microbatches 8 [--chunks 2] [--forward-only] [--vertical]

One row per pipeline rank, one column per tick of the lock-step model that places the communication
(every forward and backward of one chunk takes one tick; a chunk of an interleaved schedule holds
``1/chunks`` of a rank's layers, so its tick is ``1/chunks`` as long). ``F3`` is the forward of microbatch 3,
``B3`` its backward; ``F3.1`` / ``B3.1`` the same on model chunk 1; ``.`` an idle tick (the bubble).
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from megatron.core.pipeline_parallel.actions import ActionKind
from megatron.core.pipeline_parallel.schedules import num_warmup_microbatches, schedule_timeline


def _cell(action) -> str:
    letter = "F" if action.kind is ActionKind.FORWARD else "B"
    return f"{letter}{action.microbatch}" + (f".{action.chunk}" if action.chunk else "")


def render_timeline(
    pp_size: int, num_microbatches: int, num_chunks: int = 1, forward_only: bool = False, vertical: bool = False
) -> str:
    """The timeline table as text (ranks as rows, or as columns when ``vertical``) and a summary line."""
    timeline = schedule_timeline(pp_size, num_microbatches, num_chunks, forward_only)
    num_ticks = 1 + max(t for rank in timeline for t, _ in rank)
    grid: List[List[str]] = [["."] * num_ticks for _ in range(pp_size)]
    for r, rank in enumerate(timeline):
        for t, action in rank:
            grid[r][t] = _cell(action)
    width = max(len(cell) for row in grid for cell in row)
    if vertical:
        width = max(width, len(f"rank {pp_size - 1}"))
        lines = ["tick  " + " ".join(f"{f'rank {r}':<{width}}" for r in range(pp_size)).rstrip()]
        for t in range(num_ticks):
            lines.append(f"{t:>4}  " + " ".join(f"{grid[r][t]:<{width}}" for r in range(pp_size)).rstrip())
    else:
        label = "rank {r}: "
        lines = [" " * len(label.format(r=0)) + " ".join(f"{t:<{width}}" for t in range(num_ticks)).rstrip()]
        for r, row in enumerate(grid):
            lines.append(label.format(r=r) + " ".join(f"{cell:<{width}}" for cell in row).rstrip())
    lines.append("")
    busy = len(timeline[0])
    kind = "forward-only" if forward_only else ("interleaved 1F1B" if num_chunks > 1 else "1F1B")
    lines.append(
        f"{kind}: pp={pp_size}, microbatches={num_microbatches}, chunks={num_chunks}; {num_ticks} ticks, "
        f"{busy} busy per rank, bubble {num_ticks - busy} ticks ({100.0 * (num_ticks - busy) / num_ticks:.0f}%)"
    )
    if not forward_only:
        warm = [num_warmup_microbatches(pp_size, r, num_microbatches, num_chunks) for r in range(pp_size)]
        lines.append("warmup forwards per rank: " + ", ".join(str(w) for w in warm))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline-model-parallel size")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    parser.add_argument("--chunks", type=int, default=1, help="model chunks per rank (virtual pipeline size)")
    parser.add_argument("--forward-only", action="store_true", help="evaluation schedule (no backward)")
    parser.add_argument("--vertical", action="store_true", help="one row per tick, one column per rank")
    args = parser.parse_args(argv)
    try:
        print(render_timeline(args.pp, args.microbatches, args.chunks, args.forward_only, args.vertical))
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
