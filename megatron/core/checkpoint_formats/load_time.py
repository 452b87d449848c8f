"""One rank's share of a loaded checkpoint at the running layout: what ``--load`` needs, resharded if it must be."""

from __future__ import annotations

import os
import pickle
from typing import List, Optional, Tuple

import torch

from megatron.core.checkpoint_formats.common import LoadedCheckpoint, rank_files
from megatron.core.checkpoint_formats.layout import GPT, ModelDims, ModelFamily
from megatron.core.checkpoint_formats.optimizer_state import named_to_ours, reshard_named
from megatron.core.checkpoint_formats.reshard import layout_of, reshard
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError


def checkpoint_format(iter_dir: str) -> Optional[str]:
    """Which writer made the iteration folder ``iter_dir``: ``"torch_dist"`` (Megatron-Core's distributed
    checkpoint, recognised by its ``.metadata``), ``"megatron"`` (Megatron-LM's legacy files, whose arguments are a
    pickled ``argparse.Namespace``) or ``"ours"``; ``None`` when the folder has no readable rank file (the caller
    reports what is missing). Only the pickle's list of globals is read, never its tensors."""
    if os.path.isfile(os.path.join(iter_dir, ".metadata")):
        return "torch_dist"
    try:
        files = rank_files(iter_dir)
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(files[min(files)])
    except (CheckpointFormatError, OSError, RuntimeError, ValueError, pickle.UnpicklingError):
        return None
    return "megatron" if "argparse.Namespace" in needed else "ours"


def saved_layout(iter_dir: str) -> Optional[Tuple[int, int]]:
    """``(tp, pp)`` of the ``mp_rank_TT[_PPP]`` folders of ``iter_dir``, or ``None`` when it has none."""
    try:
        files = rank_files(iter_dir)
    except CheckpointFormatError:
        return None
    return 1 + max(t for t, _ in files), 1 + max(p for _, p in files)


def state_for_rank(ckpt: LoadedCheckpoint, dims: ModelDims, tp_size: int, pp_size: int, tp_rank: int, pp_rank: int,
                   optimizer_kind: Optional[str] = None, family: ModelFamily = GPT,
                   vpp_size: Optional[int] = None) -> Tuple[List[dict], Optional[dict], Optional[dict]]:
    """``(model chunk state dicts, optimizer state dict or None, RNG state or None)`` for rank
    ``(tp_rank, pp_rank)`` of a ``tp_size x pp_size`` run.

    The model and optimizer are resharded when the checkpoint's layout differs; the optimizer state is laid out
    for our ``optimizer_kind`` wrapper ("fp32", "mixed", "distributed"; default: the checkpoint's). The RNG state
    belongs to the saved ranks, so it is returned only when the layout is unchanged."""
    src_tp, src_pp, src_vpp = layout_of(ckpt.model_state_per_rank)
    same = (src_tp, src_pp, src_vpp) == (tp_size, pp_size, vpp_size or 1)
    shards = ckpt.model_state_per_rank
    if not same:
        shards = reshard(shards, src_tp, src_pp, tp_size, pp_size, dims, family, to_vpp=vpp_size)
    rank = (tp_rank, pp_rank)
    by_name = ckpt.extra.get("optimizer_by_name")
    optimizer = None
    if by_name:
        meta = by_name[min(by_name)][1]
        named = {r: n for r, (n, _) in by_name.items()}
        if not same:
            named = reshard_named(named, dims, tp_size, pp_size, family, vpp=vpp_size)
        optimizer = named_to_ours(named[rank], meta, shards[rank], kind=optimizer_kind)
    rng = ckpt.rng.get(rank) if (same and ckpt.rng) else None
    return shards[rank], optimizer, rng
