"""Merge tensor/pipeline-parallel shards into one full state dict, and split a full state dict for any TP/PP.

Per-rank states are ``{(tp_rank, pp_rank): [chunk_state_dict, ...]}``: one state dict per virtual pipeline chunk
(a single one without interleaving), with chunk-local layer numbers as in the files. The full state dict numbers
layers globally, holds each parameter once (the tied copy of the word embeddings on the last stage is dropped) and
keeps the vocabulary rows as stored. Splitting pads or trims the vocabulary rows to the target TP size's padding;
rows that exist on both sides are kept, new padding rows are zeros.

Each parameter is cut and joined by its tensor-parallel sharding (``ModelFamily.tp_sharding``, the declaration the
layers make: ``tensor_parallel.TPSharding``), so a SwiGLU's per-rank ``[gate; up]`` and the grouped QKV's whole
query groups survive any change of TP size. Merging needs ``dims`` for those two (without it every split parameter
is taken as a contiguous slice, right for the GPT-2 and BERT layouts).

The same functions reshard optimizer state: every per-parameter tensor (fp32 main copy, Adam moments) is sharded
like the parameter it belongs to.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.checkpoint_formats.layout import GPT, ModelDims, ModelFamily
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.tensor_parallel.sharding import TPSharding

RankStates = Dict[Tuple[int, int], List[Dict[str, torch.Tensor]]]


def layout_of(ranks: RankStates) -> Tuple[int, int, int]:
    """``(tp, pp, vpp)`` of a complete set of per-rank states; raises if ranks are missing."""
    tp = 1 + max(t for t, _ in ranks)
    pp = 1 + max(p for _, p in ranks)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in ranks]
    if missing:
        raise CheckpointFormatError(f"checkpoint has no state for (tp_rank, pp_rank) {missing[0]} of a "
                                    f"TP={tp} x PP={pp} layout")
    vpps = {len(chunks) for chunks in ranks.values()}
    if len(vpps) != 1:
        raise CheckpointFormatError(f"ranks hold different numbers of model chunks: {sorted(vpps)}")
    return tp, pp, vpps.pop()


def _layer_indices(sd: Dict[str, torch.Tensor], family: ModelFamily) -> List[int]:
    return sorted({i for i in (family.split_layer_name(n)[0] for n in sd) if i is not None})


def _sharding(family: ModelFamily, name: str, dims: Optional[ModelDims]) -> Optional[TPSharding]:
    if dims is None:
        dim = family.partition_dim(name)
        return None if dim is None else TPSharding(dim)
    return family.tp_sharding(name, dims)


def merge_tp_pp(ranks: RankStates, family: ModelFamily = GPT, tied: bool = True,
                dims: Optional[ModelDims] = None) -> "OrderedDict[str, torch.Tensor]":
    """One full state dict from every rank's chunks (layers renumbered globally, TP shards joined by each
    parameter's sharding; ``dims`` decides the gated MLP's and grouped QKV's, see the module docstring)."""
    tp, pp, vpp = layout_of(ranks)
    full: Dict[str, torch.Tensor] = {}
    offset = 0
    for v in range(vpp):  # virtual stages in order: chunk v of pipeline ranks 0..pp-1
        for p in range(pp):
            shards = [{k: x for k, x in ranks[(t, p)][v].items() if not k.endswith("_extra_state")}
                      for t in range(tp)]
            names = list(shards[0])
            for t in range(1, tp):
                if list(shards[t]) != names:
                    extra = sorted(set(shards[t]) ^ set(names))
                    raise CheckpointFormatError(f"tensor-parallel ranks 0 and {t} of pipeline rank {p} hold "
                                                f"different parameters (e.g. {extra[:1]})")
            local = _layer_indices(shards[0], family)
            if local and local != list(range(len(local))):
                raise CheckpointFormatError(f"pipeline rank {p} chunk {v} numbers its layers {local}, expected "
                                            f"0..{len(local) - 1}")
            last = p == pp - 1 and v == vpp - 1
            first = p == 0 and v == 0
            for name in names:
                if not family.known(name):
                    raise CheckpointFormatError(f"unknown {family.name} parameter {name} on (tp_rank 0, pp_rank {p})")
                if tied and name == family.tied_output and not first:
                    continue  # the last stage's copy of the tied word embeddings
                if tied and name == family.tied_output and first and not last:
                    raise CheckpointFormatError(f"{name} on the first pipeline stage of a tied-embedding model")
                index, rel = family.split_layer_name(name)
                gname = family.layer_name(index + offset, rel) if index is not None else name
                sharding = _sharding(family, name, dims)
                values = [s[name] for s in shards]
                # partitioned: [n/tp, ...] x tp -> [n, ...] along the partition dim; replicated: rank 0's copy
                full[gname] = values[0] if sharding is None else sharding.merge(values)
                if not last and name in family.last_stage:
                    raise CheckpointFormatError(f"{name} found on a pipeline stage that is not the last")
            offset += len(local)
    order = family.full_order(offset, tied)
    unordered = [n for n in full if n not in order]
    if unordered:
        raise CheckpointFormatError(f"parameter {unordered[0]} does not belong to a tied={tied} {family.name} model")
    return OrderedDict((n, full[n]) for n in order if n in full)


def resize_vocab_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Keep the first ``rows`` rows; append zero rows when ``rows`` is larger."""
    if t.shape[0] >= rows:
        return t[:rows]
    pad = torch.zeros((rows - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0)  # [rows, h]


def split_tp_pp(full: Dict[str, torch.Tensor], dims: ModelDims, tp: int, pp: int, family: ModelFamily = GPT,
                vpp: Optional[int] = None, first_stage_layers: Optional[int] = None,
                last_stage_layers: Optional[int] = None) -> RankStates:
    """Per-rank chunk state dicts of ``full`` for a TP x PP (x virtual) layout, in our module order."""
    if dims.num_attention_heads % tp != 0:
        raise CheckpointFormatError(f"--target-tensor-parallel-size {tp} does not divide the "
                                    f"{dims.num_attention_heads} attention heads")
    if dims.ffn_hidden_size % tp != 0:
        raise CheckpointFormatError(f"--target-tensor-parallel-size {tp} does not divide the FFN size "
                                    f"{dims.ffn_hidden_size}")
    rows = dims.padded_for(tp)
    tied = dims.tied_embeddings
    chunks_per_rank = vpp or 1
    out: RankStates = {(t, p): [] for t in range(tp) for p in range(pp)}
    for p in range(pp):
        for v in range(chunks_per_rank):
            try:
                offset, count = layers_for_stage(dims.num_layers, pp, p, vpp_size=vpp, vpp_rank=v,
                                                 first_stage_layers=first_stage_layers,
                                                 last_stage_layers=last_stage_layers)
            except ValueError as exc:
                raise CheckpointFormatError(f"--target-pipeline-parallel-size {pp}: {exc}") from exc
            first = p == 0 and v == 0
            last = p == pp - 1 and v == chunks_per_rank - 1
            names: List[Tuple[str, str]] = []  # (local name, full name)
            if first:
                names += [(n, n) for n in family.first_stage]
            for i in range(count):
                names += [(family.layer_name(i, rel), family.layer_name(offset + i, rel)) for rel in family.layer]
            if last:
                for n in family.last_stage:
                    if n == family.tied_output and tied:
                        if not first:  # the tied copy lives on the last stage when it is not also the first
                            names.append((n, family.first_stage[0]))
                    else:
                        names.append((n, n))
            pieces = [OrderedDict() for _ in range(tp)]
            for local, gname in names:
                if gname not in full:
                    if family.is_optional(gname):  # e.g. a BERT without the binary head
                        continue
                    raise CheckpointFormatError(f"the full state dict has no {gname}")
                value = full[gname]
                if family.is_vocab(local):
                    value = resize_vocab_rows(value, rows)
                sharding = family.tp_sharding(local, dims)
                try:  # [n/tp, ...] each
                    parts = [value] * tp if sharding is None else sharding.split(value, tp, gname)
                except ValueError as exc:
                    raise CheckpointFormatError(f"--target-tensor-parallel-size {tp}: {exc}") from exc
                for t in range(tp):
                    pieces[t][local] = parts[t].clone()
            for t in range(tp):
                out[(t, p)].append(pieces[t])
    return out


def reshard(state_dicts: RankStates, from_tp: int, from_pp: int, to_tp: int, to_pp: int, config: ModelDims,
            family: ModelFamily = GPT, to_vpp: Optional[int] = None) -> RankStates:
    """Per-rank model (or per-parameter optimizer) state dicts of a ``from_tp x from_pp`` layout, resharded."""
    tp, pp, _ = layout_of(state_dicts)
    if (tp, pp) != (from_tp, from_pp):
        raise CheckpointFormatError(f"the state dicts are a TP={tp} x PP={pp} layout, not TP={from_tp} x "
                                    f"PP={from_pp}")
    full = merge_tp_pp(state_dicts, family, tied=config.tied_embeddings, dims=config)
    return split_tp_pp(full, config, to_tp, to_pp, family, vpp=to_vpp)
