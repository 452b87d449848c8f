"""Megatron-LM's distributed-optimizer state in legacy checkpoints: ``distrib_optim.pt`` next to
``model_optim_rng.pt``, read by parameter name.

Facts of the format (Megatron-Core's ``DistributedOptimizer.save_parameter_state``, whose data comes from
``get_parameter_state_dp_zero``):

- The file holds ``{"buckets_coalesced": True, gbuf_index: {(param_dtype, grad_dtype): {"param", "exp_avg",
  "exp_avg_sq": flat fp32 tensors, "numel_unpadded": int}}}``; a run with several chained optimizers saves a list
  of such dicts. ``param`` is the fp32 main copy of the parameters.
- Grad buffers are numbered over the model chunks in order; inside a chunk, one buffer per (param dtype, grad
  dtype), in the order the chunk's parameters first use it (grad dtype fp32 under
  ``--accumulate-allreduce-grads-in-fp32``, which bf16 runs force).
- A buffer lays out its parameters in reverse registration order; with the distributed optimizer every parameter
  starts at a multiple of 64 elements. Buffers are cut into buckets: after a parameter whose bucket then holds at
  least the bucket size (``--ddp-bucket-size``, default ``max(40M, 1M x DP)``; no buckets without
  ``--overlap-grad-reduce``, after the first model chunk, or off the first pipeline stage), and around a pipeline
  run's tied embedding copy (its own bucket). The file concatenates the buckets without the padding at their ends,
  so a parameter's offset is its offset inside its bucket plus the sizes of the earlier buckets.
- ``model_optim_rng.pt``'s ``optimizer`` then holds only ``{"optimizer": {"param_groups": [...]}}`` (and
  ``grad_scaler`` for fp16): the hyperparameters with the step in each group.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError, load_megatron_file

KEYS = ("param", "exp_avg", "exp_avg_sq")
PARAM_ALIGN = 64


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def bucket_size_of(args: Dict[str, Any], chunk: int, pp_rank: int) -> Optional[int]:
    """The bucket size Megatron-LM's DDP used for model chunk ``chunk`` of pipeline rank ``pp_rank``."""
    if not args.get("overlap_grad_reduce") or chunk > 0 or pp_rank > 0:
        return None
    if args.get("overlap_param_gather_with_optimizer_step"):
        return None
    size = args.get("ddp_bucket_size")
    if size is None:
        size = max(40000000, 1000000 * int(args.get("data_parallel_size") or 1))
    return int(size)


def buffer_offsets(params: List[Tuple[str, int]], bucket_size: Optional[int],
                   own_bucket: Tuple[str, ...] = (), bucket_ends: Optional[List[int]] = None
                   ) -> Tuple[Dict[str, int], int]:
    """``({name: offset in the file's flat tensor}, flat length)`` for one grad buffer whose parameters are
    ``[(name, numel)]`` in registration order; ``own_bucket``: names that get a bucket of their own;
    ``bucket_ends``: when given, receives each bucket's end offset in the flat tensor."""
    ends = bucket_ends if bucket_ends is not None else []
    offsets: Dict[str, int] = {}
    base = 0  # flat offset of the current bucket
    rel = 0  # next free element inside the current bucket
    open_bucket = False
    for name, numel in reversed(params):
        rel = _pad(rel, PARAM_ALIGN)
        if name in own_bucket and open_bucket:  # close the bucket before it (its alignment padding included)
            base, rel, open_bucket = base + rel, 0, False
            ends.append(base)
        offsets[name] = base + rel
        end = rel + numel
        open_bucket = True
        if (bucket_size is not None and end >= bucket_size) or name in own_bucket:
            base, rel, open_bucket = base + end, 0, False
            ends.append(base)
        else:
            rel = end
    if open_bucket:
        ends.append(base + rel)
    return offsets, base + (rel if open_bucket else 0)


def _grad_dtype(param_dtype: torch.dtype, args: Dict[str, Any]) -> torch.dtype:
    if args.get("accumulate_allreduce_grads_in_fp32") or args.get("bf16"):
        return torch.float32
    return param_dtype


def read_distrib_optim(path: str, megatron_chunks: List[Dict[str, Any]], args: Dict[str, Any], pp_rank: int,
                       own_bucket: Tuple[str, ...] = ()) -> Dict[Tuple[int, str], Dict[str, torch.Tensor]]:
    """``{(chunk, name): {"param", "exp_avg", "exp_avg_sq"}}`` of one model-parallel rank from its
    ``distrib_optim.pt``; ``megatron_chunks`` are the rank's model state dicts as saved (Megatron-Core's
    parameter order, ``_extra_state`` entries included or not)."""
    return per_param_from_buffers(load_megatron_file(path), path, megatron_chunks, args, pp_rank, own_bucket)


def per_param_from_buffers(state: Any, path: str, megatron_chunks: List[Dict[str, Any]], args: Dict[str, Any],
                           pp_rank: int, own_bucket: Tuple[str, ...] = ()) -> Dict[Tuple[int, str],
                                                                                   Dict[str, torch.Tensor]]:
    """:func:`read_distrib_optim` of the file's content ``state`` (``path`` names it in messages)."""
    if isinstance(state, list):
        if len(state) != 1:
            raise CheckpointFormatError(f"{path}: {len(state)} chained optimizers (expert or decoupled "
                                        "parameter groups) are not supported")
        state = state[0]
    if not isinstance(state, dict) or not state.get("buckets_coalesced"):
        raise CheckpointFormatError(f"{path}: not the bucket-coalesced layout of Megatron-Core's "
                                    "DistributedOptimizer.save_parameter_state (older per-bucket files are not read)")
    out: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
    gbuf = 0
    for c, chunk in enumerate(megatron_chunks):
        for dtype, params in _params_by_dtype(chunk).items():
            key = (dtype, _grad_dtype(dtype, args))
            entry = state.get(gbuf, {}).get(key) if isinstance(state.get(gbuf), dict) else None
            if entry is None:
                found = sorted(str(k) for k in (state.get(gbuf) or {})) if isinstance(state.get(gbuf), dict) else []
                raise CheckpointFormatError(f"{path}: grad buffer {gbuf} has no {key} entry (found {found}); the "
                                            "model's parameters do not match this file")
            offsets, length = buffer_offsets([(n, v.numel()) for n, v in params], bucket_size_of(args, c, pp_rank),
                                             own_bucket)
            if length != int(entry["numel_unpadded"]) or any(entry[k].numel() != length for k in KEYS):
                raise CheckpointFormatError(
                    f"{path}: grad buffer {gbuf} holds {int(entry['numel_unpadded'])} elements, the model's "
                    f"parameters lay out {length} (bucket size {bucket_size_of(args, c, pp_rank)}); check "
                    "--ddp-bucket-size/--overlap-grad-reduce in the saved arguments")
            for name, value in params:
                start = offsets[name]
                out[(c, name)] = {k: entry[k][start:start + value.numel()].view(value.shape).clone() for k in KEYS}
            gbuf += 1
    extra = [k for k in state if isinstance(k, int) and k >= gbuf]
    if extra:
        raise CheckpointFormatError(f"{path}: grad buffer {extra[0]} has no parameters in the model")
    return out


def _params_by_dtype(chunk: Dict[str, Any]) -> Dict[torch.dtype, List[Tuple[str, torch.Tensor]]]:
    """A Megatron model chunk's tensors (``_extra_state`` entries left out) grouped by dtype, in the chunk's order:
    one grad buffer per dtype, as Megatron-Core's DDP lays them out."""
    by_dtype: Dict[torch.dtype, List[Tuple[str, torch.Tensor]]] = {}
    for name, value in chunk.items():
        if torch.is_tensor(value) and not name.endswith("_extra_state"):
            by_dtype.setdefault(value.dtype, []).append((name, value))
    return by_dtype


def own_bucket_names(args: Dict[str, Any], family) -> Tuple[str, ...]:
    """The parameters with a grad bucket of their own: a pipeline run's tied word embedding and its output copy."""
    pp_size = int(args.get("pipeline_model_parallel_size") or 1)
    tied = not args.get("untie_embeddings_and_output_weights", False)
    return ("embedding.word_embeddings.weight", family.tied_output) if (tied and pp_size > 1) else ()


def write_distrib_optim(megatron_chunks: List[Dict[str, Any]], per_key: Dict[Tuple[int, str], Dict[str, torch.Tensor]],
                        args: Dict[str, Any], pp_rank: int, own_bucket: Tuple[str, ...] = ()) -> dict:
    """The ``distrib_optim.pt`` state of one model-parallel rank: the inverse of :func:`read_distrib_optim`.

    ``per_key``: ``{(chunk, name): {"param", "exp_avg", "exp_avg_sq"}}`` (full fp32 tensors; moments missing
    before the first step are written as zeros); the alignment gaps between parameters hold zeros."""
    out: Dict[Any, Any] = {"buckets_coalesced": True}
    gbuf = 0
    for c, chunk in enumerate(megatron_chunks):
        for dtype, params in _params_by_dtype(chunk).items():
            offsets, length = buffer_offsets([(n, v.numel()) for n, v in params], bucket_size_of(args, c, pp_rank),
                                             own_bucket)
            entry: Dict[str, Any] = {k: torch.zeros(length, dtype=torch.float32) for k in KEYS}  # [flat buffer]
            for name, value in params:
                saved = per_key.get((c, name), {})
                start = offsets[name]
                for k in KEYS:
                    source = saved.get(k)
                    if source is None and k == "param":
                        source = value
                    if source is not None:
                        entry[k][start:start + value.numel()].copy_(source.detach().reshape(-1).float())
            entry["numel_unpadded"] = length
            out[gbuf] = {(dtype, _grad_dtype(dtype, args)): entry}
            gbuf += 1
    return out


def distributed_optimizer_groups(meta: dict) -> dict:
    """What Megatron-LM's distributed optimizer saves in ``model_optim_rng.pt``: the param groups (no params), the
    step in each group, and the fp16 ``grad_scaler``."""
    groups = [dict(g) for g in meta["param_groups"]]
    if meta.get("step") is not None:
        for g in groups:
            g["step"] = float(meta["step"])
    out = {"optimizer": {"param_groups": groups}}
    if meta.get("grad_scaler") is not None:
        out["grad_scaler"] = meta["grad_scaler"]
    return out


def hyper_from_distributed(opt_sd: dict, where: str) -> Tuple[List[dict], Optional[float]]:
    """The two param groups' hyperparameters (weight-decayed first) and the step of a distributed optimizer's
    ``state_dict()`` as Megatron-LM saves it in ``model_optim_rng.pt``."""
    groups = opt_sd.get("optimizer", {}).get("param_groups")
    if not isinstance(groups, list) or len(groups) != 2:
        raise CheckpointFormatError(f"{where}: the distributed optimizer's param groups are not the two "
                                    "(weight decay, no weight decay) groups")
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) > 1:
        raise CheckpointFormatError(f"{where}: the param groups disagree on the step ({sorted(steps)})")
    hyper = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]
    if hyper[0].get("wd_mult", 1.0) == 0.0 and hyper[1].get("wd_mult", 0.0) != 0.0:
        hyper.reverse()
    return hyper, (steps.pop() if steps else None)


def buffer_buckets(megatron_chunks: List[Dict[str, Any]], args: Dict[str, Any], pp_rank: int,
                   own_bucket: Tuple[str, ...] = ()) -> Dict[int, Tuple[Tuple[torch.dtype, torch.dtype], List[int]]]:
    """``{grad buffer index: ((param dtype, grad dtype), [each bucket's end offset in the flat buffer])}`` of one
    model-parallel rank, numbered as :func:`read_distrib_optim` numbers them."""
    out = {}
    gbuf = 0
    for c, chunk in enumerate(megatron_chunks):
        for dtype, params in _params_by_dtype(chunk).items():
            ends: List[int] = []
            buffer_offsets([(n, v.numel()) for n, v in params], bucket_size_of(args, c, pp_rank), own_bucket, ends)
            out[gbuf] = ((dtype, _grad_dtype(dtype, args)), ends)
            gbuf += 1
    return out
