"""Megatron-layout checkpoints: ``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/mp_rank_TT[_PPP]/``.

Every file is written under a temporary name, hashed while it is written, fsynced and renamed; once all ranks
wrote theirs, ``iter_NNNNNNN/manifest.json`` records each file's size and SHA-256, and only then does the tracker
move, so a crash never leaves a tracker pointing at a partial checkpoint. At load the files are checked against
the manifest (see docs/reliability.md). Files hold plain types only and load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.fusions.fp8 import delayed_scaling_state, load_delayed_scaling_state
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpoint_folder as cfold
from megatron.training import checkpoint_io as cio
from megatron.training.config import CheckpointConfig

CHECKPOINT_VERSION = 3.0
TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(cio.CheckpointIOError):
    pass


def checkpoint_dir(root: str, iteration: int, pstate: ParallelState, release: bool = False) -> str:
    it = "release" if release else f"iter_{iteration:07d}"
    rank = f"mp_rank_{pstate.tp_rank:02d}" + (f"_{pstate.pp_rank:03d}" if pstate.pp_size > 1 else "")
    return os.path.join(root, it, rank)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _model_state(model: List[torch.nn.Module]) -> dict:
    if len(model) == 1:
        return {"model": model[0].state_dict()}
    return {f"model{i}": chunk.state_dict() for i, chunk in enumerate(model)}


def save_checkpoint(iteration: int, model, optimizer, scheduler, cfg: CheckpointConfig, pstate: ParallelState,
                    consumed_train_samples: int, plain_args: dict) -> str:
    """Collective: every rank calls it (the distributed optimizer gathers its state across DP).

    ``plain_args``: the run's configuration as plain types (``RunConfig.to_plain_dict``), stored as ``args``.
    """
    optim_state = None
    if optimizer is not None and not cfg.no_save_optim:
        optim_state = optimizer.state_dict()
    path = os.path.join(checkpoint_dir(cfg.save, iteration, pstate), "model_optim_rng.pt")
    if pstate.dp_rank == 0:
        state = {
            "args": plain_args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "consumed_train_samples": consumed_train_samples,
            **_model_state(model),
        }
        if optim_state is not None:
            state["optimizer"] = optim_state
            state["opt_param_scheduler"] = scheduler.state_dict()
        if not cfg.no_save_rng:
            state["rng_state"] = tensor_parallel.get_all_rng_states()
        fp8_state = delayed_scaling_state()
        if fp8_state is not None:  # --fp8-recipe delayed: the amax histories, so a resume keeps the scales
            state["fp8_delayed_scaling"] = fp8_state
    folder = cfold.iteration_dir(cfg.save, iteration)
    if pstate.rank == 0:
        cio.invalidate_manifest(folder)  # a re-save of this iteration reads as incomplete until it is done
    _barrier()
    records, error = [], None
    if pstate.dp_rank == 0:
        try:
            records.append(cio.save_torch(state, folder, os.path.relpath(path, folder)))
        except cio.CheckpointIOError as exc:
            error = exc
    records = cio.gather_records(records, error)  # every rank raises the first failing writer's line
    if pstate.rank == 0:
        cio.write_manifest(folder, iteration, records)
        cfold.remove_stale_temp_files(cfg.save, quiescent=True)
        cio.write_text_durable(os.path.join(cfg.save, TRACKER), str(iteration))
        if cfg.keep_last_checkpoints:
            cfold.prune_checkpoints(cfg.save, cfg.keep_last_checkpoints, iteration)
    _barrier()
    return path


def read_tracker(root: str) -> int:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"no checkpoint to load: {tracker} does not exist")
    text = open(tracker).read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"corrupt tracker file {tracker}: expected an iteration number, found {text!r}")


def read_saved_args(root: str) -> dict:
    """The stored arguments of the latest checkpoint under ``root`` (any rank's file; weights not read)."""
    iteration = read_tracker(root)
    it_dir = os.path.join(root, "release" if iteration == 0 else f"iter_{iteration:07d}")
    ranks = sorted(d for d in os.listdir(it_dir) if d.startswith("mp_rank_")) if os.path.isdir(it_dir) else []
    if not ranks:
        raise CheckpointError(f"no mp_rank_* folder in {it_dir}")
    path = os.path.join(it_dir, ranks[0], "model_optim_rng.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # truncated file, bad zip, foreign pickle
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    saved = state.get("args")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} holds no stored arguments")
    return dict(saved)


def load_checkpoint(model, optimizer, scheduler, cfg: CheckpointConfig, pstate: ParallelState) -> tuple:
    """Load ``cfg.load`` into the model (and optimizer, scheduler, RNG unless told not to).

    Returns ``(iteration, consumed_train_samples)``; ``(0, 0)`` when finetuning. Raises ``CheckpointError``
    with the path and the reason on a missing, corrupt or incompatible checkpoint.
    """
    root = cfg.load
    if not os.path.isdir(root):
        raise CheckpointError(f"--load directory {root} does not exist")
    iteration = read_tracker(root)
    path = os.path.join(checkpoint_dir(root, iteration, pstate, release=(iteration == 0)), "model_optim_rng.pt")
    iter_folder = os.path.dirname(os.path.dirname(path))  # ROOT/iter_NNNNNNN or ROOT/release
    mine = [os.path.relpath(path, iter_folder)] if pstate.dp_rank == 0 else []
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    chosen = cfold.choose_checkpoint(root, iteration, mine, fallback=cfg.ckpt_fallback_on_corruption,
                                     log=(lambda m: print(f"> {m}", flush=True)) if rank0 else None,
                                     folder=iter_folder if iteration == 0 else None)
    if chosen != iteration:
        iteration = chosen
        path = os.path.join(checkpoint_dir(root, iteration, pstate), "model_optim_rng.pt")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint file {path} is missing (the tracker names iteration {iteration}); was it saved with "
            f"--tensor-model-parallel-size {pstate.tp_size} and --pipeline-model-parallel-size {pstate.pp_size}?"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated file, bad zip, foreign pickle
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    saved = state.get("args", {})
    for flag, key, now in (("--tensor-model-parallel-size", "tensor_model_parallel_size", pstate.tp_size),
                           ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", pstate.pp_size)):
        if key in saved and saved[key] != now:
            raise CheckpointError(f"checkpoint {path} was saved with {flag} {saved[key]}, this run uses {now}; "
                                  "reshard it first")
    if len(model) == 1:
        keys = ["model"]
    else:
        keys = [f"model{i}" for i in range(len(model))]
    for chunk, key in zip(model, keys):
        if key not in state:
            raise CheckpointError(f"checkpoint {path} has no '{key}' entry (virtual pipeline layout differs?)")
        try:
            chunk.load_state_dict(state[key], strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {exc}") from exc
    if "fp8_delayed_scaling" in state:
        why = load_delayed_scaling_state(state["fp8_delayed_scaling"], next(model[0].parameters()).device)
        if why is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"> FP8 delayed-scaling state in {path} not restored ({why}); its sites start with current "
                  "scaling", flush=True)

    if cfg.finetune:
        return 0, 0
    if not cfg.no_load_optim and optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state; use --no-load-optim or --finetune")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if not cfg.no_load_rng:
        if "rng_state" not in state:
            raise CheckpointError(f"checkpoint {path} holds no RNG state; use --no-load-rng")
        tensor_parallel.set_all_rng_states(state["rng_state"])
    return int(state["iteration"]), int(state.get("consumed_train_samples", 0))


def latest_iteration(root: Optional[str]) -> Optional[int]:
    if not root or not os.path.isfile(os.path.join(root, TRACKER)):
        return None
    return read_tracker(root)
