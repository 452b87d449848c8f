"""Megatron-LM's legacy ``--ckpt-format torch`` checkpoints: read them into our layouts, write them from ours.

Facts of the format (Megatron-LM with Megatron-Core models): one ``model_optim_rng.pt`` per model-parallel rank in
``iter_NNNNNNN/mp_rank_TT[_PPP]/``; ``args`` is a pickled ``argparse.Namespace`` that also holds
``consumed_train_samples``; each linear layer and ``output_layer`` add an ``_extra_state`` entry (``None`` for the
local layer spec); the optimizer is the torch optimizer's state dict (fp32) or ``{optimizer, fp32_from_fp16_params
[per group], grad_scaler (fp16 only)}`` (bf16/fp16) in Megatron-Core's parameter order; ``opt_param_scheduler``
counts samples; ``rng_state`` is a list with one dict per data-parallel rank; ``num_floating_point_operations_so_far``
is top level. The distributed optimizer's ``distrib_optim.pt`` is read by ``distrib_optim.py``; ``torch_dist``
checkpoints give their model weights (``megatron_dist.py``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Optional

import numpy as np
import torch

from megatron.core.checkpoint_formats import optimizer_state as optim
from megatron.core.checkpoint_formats.common import (FILE, LoadedCheckpoint, atomic_save, chunk_keys, model_chunks,
                                                     rank_dir, rank_files, read_tracker,
                                                     to_family_order, write_tracker)
from megatron.core.checkpoint_formats.distrib_optim import hyper_from_distributed, read_distrib_optim
from megatron.core.checkpoint_formats.layout import GPT, ModelDims, ModelFamily, check_supported_args
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError, load_megatron_file, to_plain

CHECKPOINT_VERSION = 3.0
DISTRIB_OPTIM = "distrib_optim.pt"


def _tensorless(opt_sd: dict) -> bool:
    """The distributed optimizer's ``state_dict()``: param groups only (its tensors live in distrib_optim.pt)."""
    inner = opt_sd.get("optimizer")
    return (isinstance(inner, dict) and "state" not in inner and "fp32_from_fp16_params" not in opt_sd
            and "param_groups" in inner)


def _distributed_to_named(opt_sd: dict, distrib: str, mg_chunks, plain_mg, args: Dict[str, Any], rank, family,
                          where: str):
    """The distributed optimizer's state of one rank (``distrib_optim.pt`` + the param groups in
    ``model_optim_rng.pt``) by parameter name; see ``distrib_optim.py``."""
    if not os.path.exists(distrib):
        raise CheckpointFormatError(f"{where} holds a distributed optimizer's param groups but {distrib} is "
                                    "missing; load without the optimizer (--no-load-optim)")
    pp_size = int(args.get("pipeline_model_parallel_size") or 1)
    tied = not args.get("untie_embeddings_and_output_weights", False)
    own_bucket = ("embedding.word_embeddings.weight", family.tied_output) if (tied and pp_size > 1) else ()
    per_key = read_distrib_optim(distrib, mg_chunks, args, rank[1], own_bucket)
    hyper, step = hyper_from_distributed(opt_sd, where)
    meta = {"kind": "distributed", "param_groups": hyper, "step": step, "grad_scaler": opt_sd.get("grad_scaler")}
    return optim.named_from_keys(plain_mg, per_key), meta


# ---- scheduler and RNG layouts --------------------------------------------------------------------------------
def _global_batch(args: Dict[str, Any], where: str) -> int:
    gbs = args.get("global_batch_size")
    if not gbs:
        raise CheckpointFormatError(f"{where}: the saved arguments lack global_batch_size, needed to convert the "
                                    "scheduler between samples and iterations")
    return int(gbs)


def scheduler_from_megatron(sched: dict, args: Dict[str, Any], where: str) -> dict:
    """Megatron-LM's sample-based scheduler state as ours (steps in iterations)."""
    gbs = _global_batch(args, where)
    if args.get("rampup_batch_size"):
        raise CheckpointFormatError(f"{where}: --rampup-batch-size runs count samples unevenly; their scheduler "
                                    "cannot be mapped to iterations")
    if sched.get("wd_incr_style", "constant") != "constant" or sched.get("start_wd") != sched.get("end_wd"):
        raise CheckpointFormatError(f"{where}: --weight-decay-incr-style {sched.get('wd_incr_style')} (start_wd "
                                    f"{sched.get('start_wd')} -> end_wd {sched.get('end_wd')}) is not supported")
    return {"max_lr": sched["max_lr"], "min_lr": sched["min_lr"], "warmup_steps": sched["lr_warmup_steps"] // gbs,
            "decay_steps": sched["lr_decay_steps"] // gbs, "decay_style": sched["lr_decay_style"],
            "weight_decay": sched["start_wd"], "num_steps": sched["num_steps"] // gbs}


def scheduler_to_megatron(sched: dict, args: Dict[str, Any]) -> dict:
    gbs = _global_batch(args, "our checkpoint")
    return {"max_lr": sched["max_lr"], "lr_warmup_steps": sched["warmup_steps"] * gbs,
            "num_steps": sched["num_steps"] * gbs, "lr_decay_style": sched["decay_style"],
            "lr_decay_steps": sched["decay_steps"] * gbs, "min_lr": sched["min_lr"],
            "start_wd": sched["weight_decay"], "end_wd": sched["weight_decay"], "wd_incr_style": "constant",
            "wd_incr_steps": sched["decay_steps"] * gbs}


def rng_from_megatron(rng_list, where: str) -> dict:
    """Data-parallel rank 0's Megatron-LM RNG state as ours. Megatron's tracker holds CUDA states only; each
    tracked name gets the default CPU state as its CPU stream."""
    if not isinstance(rng_list, (list, tuple)) or not rng_list:
        raise CheckpointFormatError(f"{where}: rng_state is not a list of per-rank dicts")
    r = rng_list[0]
    version, state, gauss = r["random_rng_state"]
    name, keys, pos, has_gauss, cached = r["np_rng_state"]
    cpu = r["torch_rng_state"]
    return {"random": [version, list(state), gauss],
            "np_random": [name, torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss),
                          float(cached)],
            "torch_cpu": cpu, "cuda": r.get("cuda_rng_state"),
            "tracker": {k: {"cpu": cpu.clone(), "cuda": v} for k, v in r.get("rng_tracker_states", {}).items()}}


def rng_to_megatron(ours: dict) -> Optional[list]:
    """Ours as Megatron-LM's per-rank list; ``None`` when the state has no CUDA part (Megatron restores CUDA)."""
    if ours.get("cuda") is None or any(st.get("cuda") is None for st in ours["tracker"].values()):
        return None
    version, state, gauss = ours["random"]
    name, keys, pos, has_gauss, cached = ours["np_random"]
    return [{"random_rng_state": (version, tuple(state), gauss),
             "np_rng_state": (name, np.asarray(keys.numpy() if torch.is_tensor(keys) else keys).astype(np.uint32),
                              int(pos), int(has_gauss), float(cached)),
             "torch_rng_state": ours["torch_cpu"], "cuda_rng_state": ours["cuda"],
             "rng_tracker_states": {k: st["cuda"] for k, st in ours["tracker"].items()}}]


# ---- read ---------------------------------------------------------------------------------------------------------
def read_megatron_checkpoint(root: str, family: ModelFamily = GPT, load_optim: bool = True,
                             load_rng: bool = True) -> LoadedCheckpoint:
    """Read a Megatron-LM legacy checkpoint folder (any TP/PP) into our layouts.

    Returns ``(model_state_per_rank, optimizer, scheduler, rng, iteration, consumed_samples, args_dict, extra)``:
    model state dicts without ``_extra_state`` (our module order), our trainer's optimizer state dicts (same
    precision wrapper, our parameter order), our scheduler state (iterations), our RNG state per rank.
    A ``torch_dist`` folder gives its model weights only (``megatron_dist.read_torch_dist_checkpoint``)."""
    iteration, iter_dir = read_tracker(root)
    if os.path.isfile(os.path.join(iter_dir, ".metadata")):  # torch_dist: model weights only
        from megatron.core.checkpoint_formats.megatron_dist import read_torch_dist_checkpoint

        return read_torch_dist_checkpoint(root, family)
    files = rank_files(iter_dir)
    models, optimizers, named, rngs = {}, {}, {}, {}
    sched_raw, args, first = None, None, None
    for rank, path in sorted(files.items()):
        state = load_megatron_file(path)
        if not isinstance(state, dict) or "args" not in state:
            raise CheckpointFormatError(f"{path} is not a Megatron-LM training checkpoint (no 'args')")
        if isinstance(state["args"], dict):
            raise CheckpointFormatError(f"{path} stores its arguments as a plain dict: it is one of our checkpoints "
                                        "(read it with --loader ours)")
        if args is None:
            args, first = to_plain(state["args"]), state
            check_supported_args(args, path)
        mg_chunks = model_chunks(state, path)
        ours_chunks = [to_family_order(c, family, megatron=False) for c in mg_chunks]
        models[rank] = ours_chunks
        if load_optim and state.get("optimizer") is not None:
            plain_mg = [to_family_order(c, family, megatron=True) for c in mg_chunks]
            distrib = os.path.join(os.path.dirname(path), DISTRIB_OPTIM)
            if os.path.exists(distrib) or _tensorless(state["optimizer"]):
                n, meta = _distributed_to_named(state["optimizer"], distrib, mg_chunks, plain_mg, args, rank,
                                                family, path)
            else:
                n, meta = optim.megatron_to_named(state["optimizer"], plain_mg, path)
            named[rank] = (n, meta)
            optimizers[rank] = optim.named_to_ours(n, meta, ours_chunks)
        if load_rng and state.get("rng_state") is not None:
            rngs[rank] = rng_from_megatron(state["rng_state"], path)
        if sched_raw is None:
            sched_raw = state.get("opt_param_scheduler")
    where = files[min(files)]
    consumed = int(args.get("consumed_train_samples") or 0)
    sched = scheduler_from_megatron(sched_raw, args, where) if (load_optim and sched_raw) else None
    extra = {"format": "megatron", "megatron_scheduler": sched_raw, "optimizer_by_name": named or None,
             "checkpoint_version": first.get("checkpoint_version"),
             "num_floating_point_operations_so_far": first.get("num_floating_point_operations_so_far"),
             "iter_dir": iter_dir}
    return LoadedCheckpoint(models, optimizers or None, sched, rngs or None, int(first.get("iteration", iteration)),
                            consumed, args, extra)


# ---- write --------------------------------------------------------------------------------------------------------
def megatron_model_state(chunk: Dict[str, torch.Tensor], family: ModelFamily) -> Dict[str, Any]:
    """Our chunk state dict as Megatron-Core writes it: its module order and ``_extra_state`` entries."""
    ordered = to_family_order(chunk, family, megatron=True)
    out: Dict[str, Any] = {}
    extra_layer = set(family.megatron_extra_state_layer)
    for name, value in ordered.items():
        out[name] = value
        index, rel = family.split_layer_name(name)
        module = rel.rsplit(".", 1)[0]
        if name.endswith(".bias") and (module in extra_layer if index is not None else False):
            out[name[: -len("bias")] + "_extra_state"] = None
    last = any(n in family.last_stage for n in ordered)
    if last:
        for module in family.megatron_extra_state_global:
            out[f"{module}._extra_state"] = None
    return out


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def megatron_args(args: Dict[str, Any], dims: ModelDims, tp: int, pp: int, consumed: int,
                  iteration: int) -> argparse.Namespace:
    """An ``argparse.Namespace`` of the model's flags as Megatron-LM saves them."""
    plain = {k: v for k, v in args.items() if not (isinstance(v, str) and v.startswith(("ModelType.", "AttnBackend.")))}
    plain.update(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_attention_heads, kv_channels=dims.hidden_size // dims.num_attention_heads,
        max_position_embeddings=dims.max_position_embeddings,
        seq_length=dims.seq_length or dims.max_position_embeddings,
        padded_vocab_size=dims.padded_for(tp), make_vocab_size_divisible_by=dims.make_vocab_size_divisible_by,
        layernorm_epsilon=dims.layernorm_epsilon, apply_layernorm_1p=dims.apply_layernorm_1p,
        untie_embeddings_and_output_weights=not dims.tied_embeddings, position_embedding_type="learned_absolute",
        normalization="LayerNorm", add_bias_linear=True, add_position_embedding=True, swiglu=False,
        group_query_attention=False, num_query_groups=dims.num_attention_heads,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, consumed_train_samples=consumed,
        consumed_valid_samples=int(args.get("consumed_valid_samples") or 0), iteration=iteration,
        params_dtype=_DTYPES.get(dims.params_dtype, torch.float32), bf16=dims.params_dtype == "bfloat16",
        fp16=dims.params_dtype == "float16", ckpt_format="torch",
        use_distributed_optimizer=False)  # the optimizer is written in the non-distributed layout
    return argparse.Namespace(**plain)


def write_megatron_checkpoint(root: str, model_state_per_rank, dims: ModelDims, args: Dict[str, Any],
                              iteration: int = 0, consumed_samples: int = 0, family: ModelFamily = GPT,
                              optimizer_by_name=None, scheduler: Optional[dict] = None, rng=None,
                              release: bool = False, num_floating_point_operations_so_far: float = 0.0) -> list:
    """Write ``model_state_per_rank`` (our names, ``{(tp, pp): [chunks]}``) as a Megatron-LM legacy checkpoint.

    ``optimizer_by_name``: ``{(tp, pp): (named, meta)}`` for the same layout (see ``optimizer_state``);
    ``scheduler``: ours (iterations); ``rng``: ``{(tp, pp): ours}``. Returns the files written."""
    tp = 1 + max(t for t, _ in model_state_per_rank)
    pp = 1 + max(p for _, p in model_state_per_rank)
    ns = megatron_args(args, dims, tp, pp, consumed_samples, iteration)
    written = []
    for (t, p), chunks in sorted(model_state_per_rank.items()):
        mg_chunks = [megatron_model_state(c, family) for c in chunks]
        state: Dict[str, Any] = {"args": ns, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                                 "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
        for key, c in zip(chunk_keys(len(chunks)), mg_chunks):
            state[key] = c
        if optimizer_by_name is not None:
            named, meta = optimizer_by_name[(t, p)]
            plain_mg = [to_family_order(c, family, megatron=True) for c in chunks]
            state["optimizer"] = optim.named_to_megatron(named, meta, plain_mg,
                                                         mixed_precision=dims.params_dtype != "float32")
            if scheduler is not None:
                state["opt_param_scheduler"] = scheduler_to_megatron(scheduler, args)
        if rng is not None and (t, p) in rng:
            mg_rng = rng_to_megatron(rng[(t, p)])
            if mg_rng is not None:
                state["rng_state"] = mg_rng
        path = os.path.join(rank_dir(root, iteration, t, p, pp, release), FILE)
        atomic_save(state, path)
        written.append(path)
    write_tracker(root, iteration, release)
    return written
