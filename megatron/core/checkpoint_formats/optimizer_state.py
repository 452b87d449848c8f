"""Optimizer state by parameter name, to and from our trainer's layouts and Megatron-LM's.

The by-name form of one rank is ``(named, meta)``: ``named`` mirrors the rank's model chunks,
``[{param_name: {"param": fp32 main copy (mixed precision only), "exp_avg": ..., "exp_avg_sq": ...}}]``, and
``meta`` holds what is not per parameter: ``kind`` ("fp32", "mixed" or "distributed"), the two param groups'
hyperparameters (weight-decayed first, then not decayed), the scalar ``step`` and the fp16 ``grad_scaler``.

Both frameworks put matrices in a weight-decayed group and biases/norm parameters (1-D) in a group without weight
decay, chunk after chunk. Inside a group the order is the modules' registration order: ours lists a layer's
``linear_qkv`` before ``linear_proj``, Megatron-Core the other way round. Our distributed optimizer saves every
parameter in module order instead (``params``), with full tensors.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron.core.checkpoint_formats.layout import ModelFamily
from megatron.core.checkpoint_formats.reshard import RankStates, merge_tp_pp, split_tp_pp
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError

Named = List[Dict[str, Dict[str, torch.Tensor]]]
TENSOR_KEYS = ("exp_avg", "exp_avg_sq")


def _param_names(chunks: List[Dict[str, torch.Tensor]]) -> List[List[str]]:
    return [[n for n in c if not n.endswith("_extra_state") and torch.is_tensor(c[n])] for c in chunks]


def grouped_order(chunks: List[Dict[str, torch.Tensor]], megatron_rule: bool = False) -> List[List[Tuple[int, str]]]:
    """``[decayed, not decayed]`` lists of ``(chunk, name)`` in the order the chunks' state dicts list them."""
    decay, no_decay = [], []
    for c, names in enumerate(_param_names(chunks)):
        for n in names:
            one_d = chunks[c][n].dim() <= 1 or (megatron_rule and n.endswith(".bias"))
            (no_decay if one_d else decay).append((c, n))
    return [decay, no_decay]


def _scalar(value) -> float:
    return float(value.item() if torch.is_tensor(value) else value)


def _from_torch_state(torch_sd: dict, groups: List[List[Tuple[int, str]]], where: str):
    """Per-(chunk, name) moments and the step from a torch optimizer state dict whose params follow ``groups``."""
    saved_groups = torch_sd["param_groups"]
    if len(saved_groups) != len(groups) or any(len(g["params"]) != len(o) for g, o in zip(saved_groups, groups)):
        raise CheckpointFormatError(
            f"{where}: the optimizer's param groups hold {[len(g['params']) for g in saved_groups]} params, the "
            f"model's weight-decay split gives {[len(o) for o in groups]}")
    out, step = {}, None
    for g, order in zip(saved_groups, groups):
        for pid, key in zip(g["params"], order):
            st = torch_sd["state"].get(pid)
            if not st:
                continue
            out[key] = {k: st[k] for k in TENSOR_KEYS if k in st}
            if "step" in st:
                step = _scalar(st["step"])
        if step is None and "step" in g:  # apex/TE FusedAdam keep the step in the group
            step = _scalar(g["step"])
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in saved_groups]
    return out, step, hyper


def _named(chunks, per_key) -> Named:
    return [{n: per_key.get((c, n), {}) for n in names} for c, names in enumerate(_param_names(chunks))]


def named_from_keys(chunks: List[Dict[str, torch.Tensor]], per_key: Dict[Tuple[int, str], dict]) -> Named:
    """The by-name form of ``{(chunk, name): entry}`` for the rank whose model state dicts are ``chunks``."""
    return _named(chunks, per_key)


def ours_to_named(opt_sd: dict, chunks: List[Dict[str, torch.Tensor]], where: str) -> Tuple[Named, dict]:
    """Our trainer's optimizer state dict of one rank (any of the three wrappers) by parameter name."""
    if opt_sd.get("distributed_optimizer"):
        order = [(c, n) for c, names in enumerate(_param_names(chunks)) for n in names]
        if len(opt_sd["params"]) != len(order):
            raise CheckpointFormatError(f"{where}: distributed optimizer state holds {len(opt_sd['params'])} "
                                        f"params, the model {len(order)}")
        per_key = {key: dict(entry) for key, entry in zip(order, opt_sd["params"])}
        meta = {"kind": "distributed", "param_groups": opt_sd["param_groups"],
                "step": opt_sd["scalar_state"].get("step"), "grad_scaler": opt_sd.get("grad_scaler")}
        return _named(chunks, per_key), meta
    groups = grouped_order(chunks)
    per_key, step, hyper = _from_torch_state(opt_sd["optimizer"], groups, where)
    kind = "fp32"
    if opt_sd.get("fp32_from_fp16_params") is not None:
        kind = "mixed"
        flat = [key for g in groups for key in g]
        mains = opt_sd["fp32_from_fp16_params"]
        if len(mains) != len(flat):
            raise CheckpointFormatError(f"{where}: {len(mains)} fp32 main params for {len(flat)} model params")
        for key, main in zip(flat, mains):
            per_key.setdefault(key, {})["param"] = main
    meta = {"kind": kind, "param_groups": hyper, "step": step, "grad_scaler": opt_sd.get("grad_scaler")}
    return _named(chunks, per_key), meta


def _torch_state(named: Named, groups, meta) -> dict:
    state, torch_groups, pid = {}, [], 0
    for g, order in enumerate(groups):
        ids = []
        for c, n in order:
            entry = named[c][n]
            if all(k in entry for k in TENSOR_KEYS):
                state[pid] = {"step": torch.tensor(float(meta["step"] or 0.0)),
                              **{k: entry[k] for k in TENSOR_KEYS}}
            ids.append(pid)
            pid += 1
        torch_groups.append(dict(meta["param_groups"][g], params=ids))
    return {"state": state, "param_groups": torch_groups}


def with_main_params(named: Named, chunks: List[Dict[str, torch.Tensor]]) -> Named:
    """Every entry with an fp32 main copy: the saved one, else the model weight itself (an fp32 run keeps none)."""
    return [{n: (e if "param" in e else dict(e, param=chunks[c][n].detach().float().clone()))
             for n, e in chunk.items()} for c, chunk in enumerate(named)]


def named_to_ours(named: Named, meta: dict, chunks: List[Dict[str, torch.Tensor]], kind: str = None) -> dict:
    """Our trainer's optimizer state dict for one rank: the ``kind`` wrapper ("fp32", "mixed" or "distributed";
    default: the source's ``meta['kind']``). A mixed-precision or distributed target takes its fp32 main params
    from the source's main copies, or from the model weights ``chunks`` when the source ran in fp32."""
    kind = kind or meta["kind"]
    if kind not in ("fp32", "mixed", "distributed"):
        raise CheckpointFormatError(f"unknown optimizer layout {kind!r} (fp32, mixed or distributed)")
    if kind in ("mixed", "distributed"):
        named = with_main_params(named, chunks)
    if kind == "distributed":
        order = [(c, n) for c, names in enumerate(_param_names(chunks)) for n in names]
        initialized = any(named[c][n] for c, n in order)
        return {"distributed_optimizer": True, "state_initialized": initialized,
                "param_groups": meta["param_groups"], "params": [named[c][n] for c, n in order],
                "scalar_state": {"step": meta["step"]} if initialized and meta["step"] is not None else {},
                "grad_scaler": meta.get("grad_scaler")}
    groups = grouped_order(chunks)
    out = {"optimizer": _torch_state(named, groups, meta), "grad_scaler": meta.get("grad_scaler")}
    if kind == "mixed":
        out["fp32_from_fp16_params"] = [named[c][n]["param"] for g in groups for c, n in g]
    return out


def megatron_to_named(opt_sd: dict, chunks: List[Dict[str, torch.Tensor]], where: str) -> Tuple[Named, dict]:
    """Megatron-LM's legacy optimizer state of one rank (``state_dict['optimizer']``) by parameter name.

    ``chunks`` are the rank's Megatron model state dicts (their key order is Megatron's parameter order)."""
    groups = grouped_order(chunks, megatron_rule=True)
    if "fp32_from_fp16_params" in opt_sd:  # bf16/fp16: Float16OptimizerWithFloat16Params
        per_key, step, hyper = _from_torch_state(opt_sd["optimizer"], groups, where)
        mains = opt_sd["fp32_from_fp16_params"]
        if [len(m) for m in mains] != [len(g) for g in groups]:
            raise CheckpointFormatError(f"{where}: fp32_from_fp16_params holds {[len(m) for m in mains]} params "
                                        f"per group, the model {[len(g) for g in groups]}")
        for order, group_mains in zip(groups, mains):
            for key, main in zip(order, group_mains):
                per_key.setdefault(key, {})["param"] = main
        meta = {"kind": "mixed", "param_groups": hyper, "step": step, "grad_scaler": opt_sd.get("grad_scaler")}
    elif "state" in opt_sd and "param_groups" in opt_sd:  # fp32: the torch optimizer's own state dict
        per_key, step, hyper = _from_torch_state(opt_sd, groups, where)
        meta = {"kind": "fp32", "param_groups": hyper, "step": step, "grad_scaler": None}
    else:
        raise CheckpointFormatError(f"{where}: optimizer state with keys {sorted(opt_sd)} is not a Megatron-LM "
                                    "legacy optimizer layout")
    return _named(chunks, per_key), meta


def named_to_megatron(named: Named, meta: dict, megatron_chunks: List[Dict[str, torch.Tensor]],
                      mixed_precision: bool) -> dict:
    """Megatron-LM's legacy optimizer state for one rank whose Megatron model state dicts are ``megatron_chunks``:
    the torch optimizer's state dict for an fp32 model, ``{optimizer, fp32_from_fp16_params}`` for bf16/fp16."""
    groups = grouped_order(megatron_chunks, megatron_rule=True)
    hyper = [dict(g) for g in meta["param_groups"]]
    torch_sd = _torch_state(named, groups, dict(meta, param_groups=hyper))
    if not mixed_precision:
        return torch_sd
    named = with_main_params(named, megatron_chunks)
    out = {"optimizer": torch_sd,
           "fp32_from_fp16_params": [[named[c][n]["param"] for c, n in g] for g in groups]}
    if meta.get("grad_scaler") is not None:
        out["grad_scaler"] = meta["grad_scaler"]
    return out


def reshard_named(named_ranks: Dict[Tuple[int, int], Named], dims, tp: int, pp: int, family: ModelFamily,
                  vpp=None) -> Dict[Tuple[int, int], Named]:
    """Reshard by-name optimizer state like the model: each per-parameter tensor key is merged and split."""
    keys = sorted({k for chunks in named_ranks.values() for c in chunks for e in c.values() for k in e})
    per_key = {}
    for key in keys:
        states: RankStates = {}
        for rank, chunks in named_ranks.items():
            states[rank] = []
            for c in chunks:
                missing = [n for n, e in c.items() if key not in e]
                if missing:
                    raise CheckpointFormatError(f"optimizer state of {missing[0]} on rank {rank} has no {key}; "
                                                "cannot reshard a partly initialised optimizer")
                states[rank].append({n: e[key] for n, e in c.items()})
        full = merge_tp_pp(states, family, tied=dims.tied_embeddings, dims=dims)
        per_key[key] = split_tp_pp(full, dims, tp, pp, family, vpp=vpp)
    out = {}
    for t in range(tp):
        for p in range(pp):
            chunks = [dict() for _ in per_key[keys[0]][(t, p)]] if keys else []
            for key in keys:
                for c, sd in enumerate(per_key[key][(t, p)]):
                    for n, value in sd.items():
                        chunks[c].setdefault(n, {})[key] = value
            out[(t, p)] = chunks
    return out
