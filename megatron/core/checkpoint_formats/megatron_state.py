"""Megatron-LM's scheduler and RNG states, shared by its legacy and ``torch_dist`` checkpoints, to and from ours.

``opt_param_scheduler`` counts samples (ours: iterations); ``rng_state`` is a list with one dict per data-parallel
rank (``random_rng_state``, ``np_rng_state``, ``torch_rng_state``, ``cuda_rng_state``, ``rng_tracker_states``).
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch

from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError


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
    """Ours as Megatron-LM's sample-based scheduler state. Megatron-LM sets ``wd_incr_steps`` to
    ``train_iters x global batch`` and checks it on resume, so it is taken from the arguments when they hold it."""
    gbs = _global_batch(args, "our checkpoint")
    wd_iters = args.get("train_iters") or sched["decay_steps"]
    return {"max_lr": sched["max_lr"], "lr_warmup_steps": sched["warmup_steps"] * gbs,
            "num_steps": sched["num_steps"] * gbs, "lr_decay_style": sched["decay_style"],
            "lr_decay_steps": sched["decay_steps"] * gbs, "min_lr": sched["min_lr"],
            "start_wd": sched["weight_decay"], "end_wd": sched["weight_decay"], "wd_incr_style": "constant",
            "wd_incr_steps": int(wd_iters) * gbs}


CPU_TRACKER_KEY = "cpu_rng_tracker_states"


def rng_from_megatron(rng_list, where: str) -> dict:
    """Data-parallel rank 0's Megatron-LM RNG state as ours. Megatron's tracker holds CUDA states only; each
    tracked name gets its CPU stream from ``cpu_rng_tracker_states`` when the file has it (our writer adds it),
    else the default CPU state."""
    if not isinstance(rng_list, (list, tuple)) or not rng_list:
        raise CheckpointFormatError(f"{where}: rng_state is not a list of per-rank dicts")
    r = rng_list[0]
    version, state, gauss = r["random_rng_state"]
    name, keys, pos, has_gauss, cached = r["np_rng_state"]
    cpu = r["torch_rng_state"]
    cpu_tracker = r.get(CPU_TRACKER_KEY) or {}
    names = set(r.get("rng_tracker_states") or {}) | set(cpu_tracker)
    cuda_tracker = r.get("rng_tracker_states") or {}
    return {"random": [version, list(state), gauss],
            "np_random": [name, torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss),
                          float(cached)],
            "torch_cpu": cpu, "cuda": r.get("cuda_rng_state"),
            "tracker": {k: {"cpu": (cpu_tracker[k] if k in cpu_tracker else cpu).clone(), "cuda": cuda_tracker.get(k)}
                        for k in sorted(names)}}


def rng_to_megatron(ours: dict) -> list:
    """Ours as Megatron-LM's per-rank list (one dict: data-parallel ranks share the streams). Megatron's keys hold
    the CUDA states (``None`` when the state was taken without a GPU: Megatron-LM then needs ``--no-load-rng``);
    ``cpu_rng_tracker_states`` adds the tracker's CPU streams, which Megatron-LM ignores and our reader restores."""
    version, state, gauss = ours["random"]
    name, keys, pos, has_gauss, cached = ours["np_random"]
    return [{"random_rng_state": (version, tuple(state), gauss),
             "np_rng_state": (name, np.asarray(keys.numpy() if torch.is_tensor(keys) else keys).astype(np.uint32),
                              int(pos), int(has_gauss), float(cached)),
             "torch_rng_state": ours["torch_cpu"], "cuda_rng_state": ours.get("cuda"),
             "rng_tracker_states": {k: st.get("cuda") for k, st in ours["tracker"].items()},
             CPU_TRACKER_KEY: {k: st["cpu"] for k, st in ours["tracker"].items()}}]
