"""Broadcast a batch from TP rank 0 to the rest of its tensor-parallel group, so only one rank reads data."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron.core.parallel_state import ParallelState, default_device
from megatron.core.tensor_parallel.mappings import broadcast_tensor

_MAX_DIMS = 8


def broadcast_data(
    keys: List[str], data: Optional[Dict[str, torch.Tensor]], dtype: torch.dtype, pstate: ParallelState
) -> Dict[str, torch.Tensor]:
    """Return ``{key: tensor}`` on every rank of the TP group, as held by TP rank 0.

    TP rank 0 passes ``data`` (each ``data[key]`` of ``dtype``, any shape up to 8 dimensions); the other ranks
    pass ``None``. Two broadcasts: the shapes (int64), then every tensor flattened into one buffer of ``dtype``.
    The results live on ``default_device()``.
    """
    device = default_device()
    group = pstate.tp_group if pstate.tp_size > 1 else None
    is_src = pstate.tp_rank == 0
    if is_src:
        if data is None:
            raise ValueError("broadcast_data: TP rank 0 must pass the data dict")
        for k in keys:
            if k not in data:
                raise ValueError(f"broadcast_data: key {k!r} missing from data (has {sorted(data)})")
            if data[k].dtype != dtype:
                raise ValueError(f"broadcast_data: data[{k!r}] has dtype {data[k].dtype}, expected {dtype}")
            if data[k].dim() > _MAX_DIMS:
                raise ValueError(f"broadcast_data: data[{k!r}] has {data[k].dim()} dims, at most {_MAX_DIMS}")
    if group is None:
        return {k: data[k].to(device) for k in keys}

    # Header: per key [ndim, d0, ..., d7].
    header = torch.zeros(len(keys), _MAX_DIMS + 1, dtype=torch.int64, device=device)
    if is_src:
        for i, k in enumerate(keys):
            shape = data[k].shape
            header[i, 0] = len(shape)
            header[i, 1:1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    broadcast_tensor(header, pstate.tp_src_rank, group)
    header = header.tolist()
    shapes = [tuple(row[1:1 + row[0]]) for row in header]
    numels = [int(torch.Size(s).numel()) for s in shapes]

    if is_src:
        flat = torch.cat([data[k].to(device).reshape(-1) for k in keys])  # [sum numel]
    else:
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
    broadcast_tensor(flat, pstate.tp_src_rank, group)
    out, offset = {}, 0
    for k, shape, n in zip(keys, shapes, numels):
        out[k] = flat[offset:offset + n].view(shape)
        offset += n
    return out
