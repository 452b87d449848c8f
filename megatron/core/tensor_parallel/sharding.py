"""How a parameter is split over tensor-parallel ranks, declared once where the parameter is made.

A split parameter carries a :class:`TPSharding` as ``param.tp_sharding`` (None for a replicated one). The full
(unsharded) tensor's dimension ``dim`` is cut into ``blocks`` equal consecutive parts, each part is cut into ``tp``
equal consecutive pieces, and rank ``r`` holds piece ``r`` of every part, concatenated in part order:

- ``TPSharding(0)``: a contiguous slice (column-parallel weights, the vocabulary rows); ``TPSharding(1)``: the
  row-parallel weights' input columns;
- ``TPSharding(0, blocks=2)``: the fused ``[gate; up]`` weight of a gated MLP, full ``[gate; up]``, rank ``r``
  holding ``[gate_r; up_r]`` (Megatron-Core's ``linear_fc1`` layout);
- ``TPSharding(0, unit=u)``: a contiguous slice whose pieces hold whole units of ``u`` rows, e.g. the grouped QKV
  weight, one unit per query group (its query heads, then its key and value head).

Initialisation (``models/init.py``), resharding (``checkpoint_formats/reshard.py``) and the format mappings cut and
join tensors with :meth:`TPSharding.split` and :meth:`TPSharding.merge` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch


@dataclass(frozen=True)
class TPSharding:
    dim: int  # the partition dimension
    blocks: int = 1  # consecutive parts of the full tensor along ``dim``, each split over the ranks
    unit: int = 1  # rows along ``dim`` that stay together on one rank (a piece holds whole units)

    def check(self, full_size: int, tp: int, what: str = "parameter") -> None:
        """Raise ValueError unless a full size of ``full_size`` along ``dim`` splits over ``tp`` ranks."""
        if full_size % self.blocks or (full_size // self.blocks) % (tp * self.unit):
            units = f" in whole units of {self.unit}" if self.unit > 1 else ""
            parts = f" in each of its {self.blocks} parts" if self.blocks > 1 else ""
            raise ValueError(f"{what}: size {full_size} along dimension {self.dim} does not split over "
                             f"{tp} tensor-parallel ranks{parts}{units}")

    def full_shape(self, local_shape: Sequence[int], tp: int) -> List[int]:
        shape = list(local_shape)
        shape[self.dim] *= tp
        return shape

    def split(self, full: torch.Tensor, tp: int, what: str = "parameter") -> List[torch.Tensor]:
        """The ``tp`` per-rank shards of ``full`` (views where possible)."""
        self.check(full.shape[self.dim], tp, what)
        if tp == 1:
            return [full]
        parts = [p.chunk(tp, dim=self.dim) for p in full.chunk(self.blocks, dim=self.dim)]
        if self.blocks == 1:
            return list(parts[0])
        return [torch.cat([p[r] for p in parts], dim=self.dim) for r in range(tp)]

    def shard(self, full: torch.Tensor, tp: int, rank: int, what: str = "parameter") -> torch.Tensor:
        """Rank ``rank``'s shard of ``full``."""
        return self.split(full, tp, what)[rank]

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (the inverse of :meth:`split`)."""
        if len(shards) == 1:
            return shards[0]
        if self.blocks == 1:
            return torch.cat(list(shards), dim=self.dim)
        per_rank = [s.chunk(self.blocks, dim=self.dim) for s in shards]
        return torch.cat([per_rank[r][b] for b in range(self.blocks) for r in range(len(shards))], dim=self.dim)


def fc1_sharding(gated_linear_unit: bool) -> TPSharding:
    """The MLP's first linear: ``[gate; up]`` per rank when gated (SwiGLU), else a contiguous slice."""
    return TPSharding(0, blocks=2 if gated_linear_unit else 1)


def qkv_sharding(num_attention_heads: int, num_query_groups: int, kv_channels: int) -> TPSharding:
    """The grouped QKV linear: a contiguous slice of whole query groups, each ``(n/g + 2) * kv_channels`` rows (its
    query heads, then its key and its value head)."""
    return TPSharding(0, unit=(num_attention_heads // num_query_groups + 2) * kv_channels)
