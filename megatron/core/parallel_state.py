"""One explicit description of the process grid.

Ranks are laid out with tensor parallelism innermost, then data parallelism, then pipeline parallelism:

    global_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the ranks of one tensor-parallel group are adjacent (one node's NVLink domain on a cluster). A
``ParallelState`` value holds every process group a layer or schedule may need; nothing in the library
reaches for the world group behind its back. A single process without ``torch.distributed`` gets
``ParallelState.single()``, whose groups are ``None`` and whose sizes are all 1: every collective helper
treats a group of size 1 as the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist


def validate_parallel_sizes(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> int:
    """Check the grid arithmetic and return the data-parallel size; raise ``ValueError`` naming the flag."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if pp < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) = {tp * pp}"
        )
    if virtual_pipeline_model_parallel_size is not None:
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError(
                f"--virtual-pipeline-model-parallel-size must be >= 1, got {virtual_pipeline_model_parallel_size}"
            )
        if virtual_pipeline_model_parallel_size > 1 and pp < 2:
            raise ValueError(
                "--virtual-pipeline-model-parallel-size > 1 needs --pipeline-model-parallel-size >= 2, "
                f"got pipeline size {pp}"
            )
    return world_size // (tp * pp)


def _grid_rank(pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    return pp_rank * (dp * tp) + dp_rank * tp + tp_rank


@dataclass
class ParallelState:
    """Ranks, sizes and process groups of one process in the (PP, DP, TP) grid."""

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    vpp_size: Optional[int] = None  # virtual pipeline chunks per stage (None: no interleaving)
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    mp_group: Optional[dist.ProcessGroup] = None  # TP x PP of one data-parallel replica
    embedding_group: Optional[dist.ProcessGroup] = None  # first and last pipeline stage (tied embeddings)
    tp_ranks: List[int] = field(default_factory=lambda: [0])
    pp_ranks: List[int] = field(default_factory=lambda: [0])
    dp_ranks: List[int] = field(default_factory=lambda: [0])
    mp_ranks: List[int] = field(default_factory=lambda: [0])
    embedding_ranks: List[int] = field(default_factory=lambda: [0])

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def single(cls) -> "ParallelState":
        """The trivial grid of one process (no torch.distributed needed)."""
        return cls()

    @classmethod
    def build(
        cls,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        timeout=None,
    ) -> "ParallelState":
        """Create every group from the initialised default process group.

        Every rank must call this with the same arguments (``new_group`` is collective). ``timeout`` (a
        ``datetime.timedelta``) bounds every collective of the groups; torch's default otherwise, not the
        default group's.
        """
        if not dist.is_initialized():
            if tensor_model_parallel_size == 1 and pipeline_model_parallel_size == 1:
                return cls.single()
            raise RuntimeError("ParallelState.build needs torch.distributed to be initialised for TP/PP > 1")
        world, rank = dist.get_world_size(), dist.get_rank()
        tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        dp = validate_parallel_sizes(world, tp, pp, virtual_pipeline_model_parallel_size)
        pp_rank, rest = divmod(rank, dp * tp)
        dp_rank, tp_rank = divmod(rest, tp)
        vpp = virtual_pipeline_model_parallel_size
        if vpp == 1:
            vpp = None

        def make(groups: List[List[int]]) -> tuple:
            chosen_group, chosen_ranks = None, []
            for ranks in groups:
                g = dist.new_group(ranks, timeout=timeout)  # collective: every rank creates every group
                if rank in ranks:
                    chosen_group, chosen_ranks = g, ranks
            return chosen_group, chosen_ranks

        tp_groups = [[_grid_rank(p, d, t, tp, dp) for t in range(tp)] for p in range(pp) for d in range(dp)]
        dp_groups = [[_grid_rank(p, d, t, tp, dp) for d in range(dp)] for p in range(pp) for t in range(tp)]
        pp_groups = [[_grid_rank(p, d, t, tp, dp) for p in range(pp)] for d in range(dp) for t in range(tp)]
        mp_groups = [
            sorted(_grid_rank(p, d, t, tp, dp) for p in range(pp) for t in range(tp)) for d in range(dp)
        ]
        emb_groups = [sorted({ranks[0], ranks[-1]}) for ranks in pp_groups]

        tp_group, tp_ranks = make(tp_groups)
        dp_group, dp_ranks = make(dp_groups)
        pp_group, pp_ranks = make(pp_groups)
        mp_group, mp_ranks = make(mp_groups)
        emb_group, emb_ranks = make(emb_groups)
        return cls(
            world_size=world, rank=rank, tp_size=tp, pp_size=pp, dp_size=dp, vpp_size=vpp,
            tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
            tp_group=tp_group, pp_group=pp_group, dp_group=dp_group, mp_group=mp_group,
            embedding_group=emb_group, tp_ranks=tp_ranks, pp_ranks=pp_ranks, dp_ranks=dp_ranks,
            mp_ranks=mp_ranks, embedding_ranks=emb_ranks,
        )

    # ---- derived facts --------------------------------------------------------------------------------
    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_pp_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this process's TP group (the one that reads data)."""
        return self.tp_ranks[0]

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks and (self.is_pipeline_first_stage or self.is_pipeline_last_stage)

    def describe(self) -> str:
        return (
            f"world {self.world_size} = TP {self.tp_size} x PP {self.pp_size} x DP {self.dp_size}"
            + (f" (virtual pipeline {self.vpp_size})" if self.vpp_size else "")
        )


def default_device() -> torch.device:
    """The device this process computes on: its local CUDA device when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
