"""Megatron-layout checkpoints: ``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/mp_rank_TT[_PPP]/``.

Every file is written under a temporary name, hashed while it is written, fsynced and renamed; once all ranks
wrote theirs, ``iter_NNNNNNN/manifest.json`` records each file's size and SHA-256, and only then does the tracker
move, so a crash never leaves a tracker pointing at a partial checkpoint. At load the files are checked against
the manifest (see docs/reliability.md). Files hold plain types only and load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import checkpoint_formats as formats
from megatron.core import tensor_parallel
from megatron.core.checkpoint_formats.common import rank_files
from megatron.core.checkpoint_formats.load_time import checkpoint_format, saved_layout
from megatron.core.checkpoint_formats.reshard import layout_of
from megatron.core.checkpoint_formats.safe_load import describe_load_error, to_plain
from megatron.core.fusions.fp8 import delayed_scaling_state, load_delayed_scaling_state
from megatron.core.parallel_state import ParallelState
from megatron.core.model_spec import spec_to_args
from megatron.training import checkpoint_folder as cfold
from megatron.core import checkpoint_io as cio
from megatron.training.config import CheckpointConfig

CHECKPOINT_VERSION = 3.0


class CheckpointError(cio.CheckpointIOError):
    pass


def checkpoint_dir(root: str, iteration: int, pstate: ParallelState, release: bool = False) -> str:
    rank = f"mp_rank_{pstate.tp_rank:02d}" + (f"_{pstate.pp_rank:03d}" if pstate.pp_size > 1 else "")
    return os.path.join(cio.iteration_dir(root, iteration, release), rank)


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
    With ``cfg.ckpt_layout == "megatron"`` the files are Megatron-LM's (``_megatron_layout_files``).
    """
    optim_state = None
    if optimizer is not None and not cfg.no_save_optim:
        optim_state = optimizer.state_dict()
    if cfg.ckpt_format == "torch_dist":
        return _save_torch_dist(iteration, model, optim_state, scheduler, cfg, pstate, consumed_train_samples,
                                plain_args)
    path = os.path.join(checkpoint_dir(cfg.save, iteration, pstate), "model_optim_rng.pt")
    files = {}
    if cfg.ckpt_layout == "megatron":
        files = _megatron_layout_files(iteration, model, optim_state, scheduler, cfg, pstate, consumed_train_samples,
                                       plain_args)
    elif pstate.dp_rank == 0:
        state = {
            "args": plain_args,
            **_spec_entry(model),
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
        files = {path: state}
    folder = cfold.iteration_dir(cfg.save, iteration)
    if pstate.rank == 0:
        cio.invalidate_manifest(folder)  # a re-save of this iteration reads as incomplete until it is done
    _barrier()
    records, error = [], None
    try:
        for file_path, obj in files.items():
            marked = {**obj, cio.MANIFEST_KEY: cio.MANIFEST_FORMAT}  # its folder gets a manifest
            records.append(cio.save_torch(marked, folder, os.path.relpath(file_path, folder)))
    except cio.CheckpointIOError as exc:
        error = exc
    records = cio.gather_records(records, error)  # every rank raises the first failing writer's line
    if pstate.rank == 0:
        cio.write_manifest(folder, iteration, records)
        cfold.remove_stale_temp_files(cfg.save, quiescent=True)
        cio.write_tracker(cfg.save, iteration)
        if cfg.keep_last_checkpoints:
            cfold.prune_checkpoints(cfg.save, cfg.keep_last_checkpoints, iteration)
    _barrier()
    return path


def _save_torch_dist(iteration: int, model, optim_state, scheduler, cfg: CheckpointConfig, pstate: ParallelState,
                     consumed_train_samples: int, plain_args: dict) -> str:
    """Collective: ``--ckpt-format torch_dist`` of a TP=1, PP=1 run, written by rank 0 with
    ``checkpoint_formats.megatron_dist`` (the converter's writer): the model, the optimizer as Megatron-LM's
    distributed optimizer state, the scheduler and rank 0's RNG state. Returns the iteration folder."""
    from megatron.core.checkpoint_formats import megatron_dist, megatron_lm, optimizer_state

    family = _family_of(model)
    rows = _padded_vocab_of(model, pstate, family)
    folder = cfold.iteration_dir(cfg.save, iteration)
    error = None
    if pstate.rank == 0:
        chunk = {n: t for n, t in model[0].state_dict().items() if torch.is_tensor(t)}
        args = dict(plain_args, padded_vocab_size=rows)
        dims = formats.dims_from_args({k: v for k, v in args.items() if k != "vocab_size"})
        by_name = None
        if optim_state is not None:
            named, meta = optimizer_state.ours_to_named(optim_state, [chunk], folder)
            groups = megatron_lm.megatron_param_groups(meta["param_groups"], scheduler.state_dict())
            by_name = (optimizer_state.with_main_params(named, [chunk]),
                       dict(meta, kind="distributed", param_groups=groups))
        ns = megatron_lm.megatron_args(args, dims, 1, 1, consumed_train_samples, iteration,
                                       distributed_optimizer=by_name is not None, ckpt_format="torch_dist",
                                       data_parallel_size=pstate.dp_size, world_size=pstate.world_size)
        rng = None if cfg.no_save_rng else tensor_parallel.get_all_rng_states()
        try:
            megatron_dist.write_torch_dist_checkpoint(
                cfg.save, chunk, dims, ns, iteration, family, optimizer_by_name=by_name,
                scheduler=scheduler.state_dict() if by_name is not None else None, rng=rng)
        except OSError as exc:
            error = CheckpointError(f"--save {cfg.save}: cannot write the torch_dist checkpoint {folder}: {exc}")
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return folder


def _spec_entry(model) -> dict:
    """``{"model_spec": the running model's ModelSpec as a plain dict}`` (empty for a model without a config)."""
    config = getattr(getattr(model[0], "module", model[0]), "config", None)
    return {formats.SPEC_KEY: config.spec.to_dict()} if hasattr(config, "spec") else {}


def _megatron_layout_files(iteration: int, model, optim_state, scheduler, cfg: CheckpointConfig,
                           pstate: ParallelState, consumed_train_samples: int, plain_args: dict) -> dict:
    """Collective (the padded vocabulary is agreed over all ranks): ``{path: state}`` this rank writes in
    Megatron-LM's layout, built by ``checkpoint_formats.megatron_lm`` (the converter's writer): data-parallel
    rank 0 of each model-parallel rank writes ``model_optim_rng.pt``, and ``distrib_optim.pt`` next to it with
    the distributed optimizer."""
    from megatron.core.checkpoint_formats import megatron_lm, optimizer_state

    family = _family_of(model)
    rows = _padded_vocab_of(model, pstate, family)
    if pstate.dp_rank != 0:
        return {}
    chunks = [{n: t for n, t in chunk.state_dict().items() if torch.is_tensor(t)} for chunk in model]
    args = dict(plain_args, padded_vocab_size=rows)
    # the sizes of the running model: its rows as they are (the tokenizer's real size is not in the arguments)
    dims = formats.dims_from_args({k: v for k, v in args.items() if k != "vocab_size"})
    path = os.path.join(checkpoint_dir(cfg.save, iteration, pstate), "model_optim_rng.pt")
    by_name = None
    if optim_state is not None:
        by_name = optimizer_state.ours_to_named(optim_state, chunks, path)
    distributed = by_name is not None and by_name[1]["kind"] == "distributed"
    ns = megatron_lm.megatron_args(args, dims, pstate.tp_size, pstate.pp_size, consumed_train_samples, iteration,
                                   vpp=len(model), distributed_optimizer=distributed,
                                   data_parallel_size=pstate.dp_size, world_size=pstate.world_size)
    rng = None if cfg.no_save_rng else tensor_parallel.get_all_rng_states()
    state, distrib = megatron_lm.megatron_rank_state(
        chunks, ns, family, by_name, scheduler.state_dict() if by_name is not None else None, rng,
        pp_rank=pstate.pp_rank)
    fp8_state = delayed_scaling_state()
    if fp8_state is not None:  # an extra entry Megatron-LM ignores; our --load restores it
        state["fp8_delayed_scaling"] = fp8_state
    files = {path: state}
    if distrib is not None:
        files[os.path.join(os.path.dirname(path), megatron_lm.DISTRIB_OPTIM)] = distrib
    return files


def read_tracker(root: str) -> int:
    """The iteration the tracker of ``root`` names (0 for ``release``); ``CheckpointIOError`` when unreadable."""
    return cio.read_tracker(root)[0]


def read_saved_args(root: str) -> dict:
    """The stored arguments of the latest checkpoint under ``root`` (any rank's file; weights not read), as plain
    types; Megatron-LM's checkpoints (a pickled ``argparse.Namespace``, or ``common.pt`` of a ``torch_dist``
    folder) are read through the safe unpickler."""
    iteration, it_dir = cio.read_tracker(root)
    fmt = checkpoint_format(it_dir) if os.path.isdir(it_dir) else None
    if fmt in ("megatron", "torch_dist"):
        path = os.path.join(it_dir, "common.pt") if fmt == "torch_dist" else next(iter(rank_files(it_dir).values()))
        try:
            saved = formats.load_megatron_file(path).get("args")
        except (formats.CheckpointFormatError, OSError) as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
        if saved is None:
            raise CheckpointError(f"checkpoint {path} holds no stored arguments")
        plain = to_plain(saved)
        if "norm_epsilon" not in plain and plain.get("layernorm_epsilon") is not None:
            plain["norm_epsilon"] = plain["layernorm_epsilon"]
        return plain
    ranks = sorted(d for d in os.listdir(it_dir) if d.startswith("mp_rank_")) if os.path.isdir(it_dir) else []
    if not ranks:
        raise CheckpointError(f"no mp_rank_* folder in {it_dir}")
    path = os.path.join(it_dir, ranks[0], "model_optim_rng.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # truncated file, bad zip, foreign pickle
        raise CheckpointError(describe_load_error(path, exc)) from exc
    saved = state.get("args")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} holds no stored arguments")
    if isinstance(state.get(formats.SPEC_KEY), dict):  # the stored model description, as the flags that give it
        try:
            return {**saved, **spec_to_args(formats.spec_from_saved({formats.SPEC_KEY: state[formats.SPEC_KEY]}))}
        except formats.CheckpointFormatError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    return dict(saved)


def load_checkpoint(model, optimizer, scheduler, cfg: CheckpointConfig, pstate: ParallelState) -> tuple:
    """Load ``cfg.load`` into the model (and optimizer, scheduler, RNG unless told not to).

    Our checkpoints saved at this run's TP/PP load rank by rank; one saved at another TP/PP, and Megatron-LM's
    legacy or ``torch_dist`` checkpoints, go through ``_load_converted`` (read every rank, reshard, map).
    Returns ``(iteration, consumed_train_samples)``; ``(0, 0)`` when finetuning. Raises ``CheckpointError``
    with the path and the reason on a missing, corrupt or incompatible checkpoint.
    """
    root = cfg.load
    iteration, iter_folder = cio.read_tracker(root)
    fmt = checkpoint_format(iter_folder) if os.path.isdir(iter_folder) else None
    if fmt in ("megatron", "torch_dist"):
        return _load_converted(model, optimizer, scheduler, cfg, pstate, iteration, iter_folder, fmt)
    layout = saved_layout(iter_folder) if fmt == "ours" else None
    if layout is not None and layout != (pstate.tp_size, pstate.pp_size):
        return _load_converted(model, optimizer, scheduler, cfg, pstate, iteration, iter_folder, fmt)
    path = os.path.join(checkpoint_dir(root, iteration, pstate, release=(iteration == 0)), "model_optim_rng.pt")
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
        raise CheckpointError(describe_load_error(path, exc)) from exc
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


# ---- checkpoints that need converting: another TP/PP, Megatron-LM's legacy files, torch_dist ----------------------
_FORMAT_NAMES = {"ours": "checkpoint", "megatron": "Megatron-LM checkpoint",
                 "torch_dist": "Megatron-Core torch_dist checkpoint"}


def _print0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"> {message}", flush=True)


def _optimizer_kind(optimizer) -> Optional[str]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer

    for cls, kind in ((DistributedOptimizer, "distributed"), (MixedPrecisionOptimizer, "mixed"),
                      (FP32Optimizer, "fp32")):
        if isinstance(optimizer, cls):
            return kind
    return None


def _family_of(model) -> "formats.ModelFamily":
    """The checkpoint layout of the running model, from its parameter names."""
    names = [n for chunk in model for n, _ in chunk.named_parameters()]
    if any(".encoder.layers." in f".{n}" for n in names):
        return formats.get_family("BERT")
    return formats.GPT


def _padded_vocab_of(model, pstate: ParallelState, family) -> Optional[int]:
    """The running model's padded vocabulary (embedding rows x TP), agreed over every rank (a middle pipeline
    stage holds no embedding)."""
    vocab_names = set(family.vocab_params)
    rows = 0
    for chunk in model:
        for name, param in chunk.named_parameters():
            plain = name[len("module."):] if name.startswith("module.") else name
            if plain in vocab_names:
                rows = max(rows, param.shape[0] * pstate.tp_size)
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        rows = max(gathered)
    return rows or None


def _load_converted(model, optimizer, scheduler, cfg: CheckpointConfig, pstate: ParallelState, iteration: int,
                    iter_folder: str, fmt: Optional[str]) -> tuple:
    """Every rank reads every rank's file, reshards model and optimizer to this run's layout
    (``checkpoint_formats.state_for_rank``) and loads its share. RNG states belong to the saved ranks: restored
    only when the layout is unchanged."""
    root = cfg.load
    what = _FORMAT_NAMES.get(fmt, "checkpoint")
    want_optim = not cfg.finetune and not cfg.no_load_optim and optimizer is not None
    want_rng = not cfg.finetune and not cfg.no_load_rng
    vpp = len(model) if len(model) > 1 else None
    try:
        family = _family_of(model)
        if fmt == "ours":
            files = rank_files(iter_folder)
            rels = [os.path.relpath(p, iter_folder) for p in files.values()]
            rank0 = not dist.is_initialized() or dist.get_rank() == 0
            chosen = cfold.choose_checkpoint(root, iteration, rels if rank0 else [],
                                             fallback=cfg.ckpt_fallback_on_corruption,
                                             log=(lambda m: print(f"> {m}", flush=True)) if rank0 else None,
                                             folder=iter_folder if iteration == 0 else None)
            ckpt = formats.read_our_checkpoint(root, load_optim=want_optim, load_rng=want_rng,
                                               iteration=chosen if chosen != iteration else None)
        else:
            chosen = iteration
            if fmt == "megatron" and os.path.isfile(os.path.join(iter_folder, cio.MANIFEST)):
                # written by our trainer (--ckpt-layout megatron): verify every file against the manifest
                rank0 = not dist.is_initialized() or dist.get_rank() == 0
                rels = [os.path.relpath(os.path.join(dp, f), iter_folder) for dp, _, fs in os.walk(iter_folder)
                        for f in fs if f.endswith(".pt")]
                chosen = cfold.choose_checkpoint(root, iteration, sorted(rels) if rank0 else [],
                                                 fallback=cfg.ckpt_fallback_on_corruption,
                                                 log=(lambda m: print(f"> {m}", flush=True)) if rank0 else None)
            ckpt = formats.read_megatron_checkpoint(root, family, load_optim=want_optim, load_rng=want_rng,
                                                    iteration=chosen if chosen != iteration else None)
        dims = formats.dims_from_args(ckpt.args_dict)
        rows = _padded_vocab_of(model, pstate, family)
        if rows is not None and rows != dims.padded_for(pstate.tp_size):
            dims = dataclasses.replace(dims, vocab_size=rows, make_vocab_size_divisible_by=1)
        src_tp, src_pp, src_vpp = layout_of(ckpt.model_state_per_rank)
        chunks, optim_state, rng = formats.state_for_rank(
            ckpt, dims, pstate.tp_size, pstate.pp_size, pstate.tp_rank, pstate.pp_rank,
            optimizer_kind=_optimizer_kind(optimizer), family=family, vpp_size=vpp)
    except formats.CheckpointFormatError as exc:
        raise CheckpointError(f"--load {root}: {exc}") from exc
    resharded = (src_tp, src_pp, src_vpp) != (pstate.tp_size, pstate.pp_size, vpp or 1)
    saved = f"TP={src_tp}, PP={src_pp}" + (f", virtual PP={src_vpp}" if src_vpp > 1 else "")
    if resharded:
        _print0(f"resharding the {what} in {root} (saved at {saved}) to TP={pstate.tp_size}, PP={pstate.pp_size}"
                + (f", virtual PP={vpp}" if vpp else ""))
    elif fmt != "ours":
        _print0(f"reading the {what} in {root} (iteration {ckpt.iteration}, {saved})")
    if len(chunks) != len(model):
        raise CheckpointError(f"--load {root}: {len(chunks)} model chunks for this rank, the run has {len(model)}")
    for chunk, sd in zip(model, chunks):
        try:
            chunk.load_state_dict(sd, strict=True)
        except RuntimeError as exc:
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            detail = [line for line in lines[1:] if line.startswith(("size mismatch", "Missing", "Unexpected"))]
            more = f" (and {len(detail) - 1} more)" if len(detail) > 1 else ""
            raise CheckpointError(f"--load {root}: the {what} does not fit this model: "
                                  f"{detail[0] if detail else lines[0]}{more}") from exc
    if ckpt.extra.get("fp8_delayed_scaling") is not None:
        why = "the checkpoint was resharded"
        if not resharded and fmt == "megatron":  # one state per rank: {(tp, pp): state}
            why = load_delayed_scaling_state(ckpt.extra["fp8_delayed_scaling"][(pstate.tp_rank, pstate.pp_rank)],
                                             next(model[0].parameters()).device)
        if why is not None:
            _print0(f"FP8 delayed-scaling state not restored ({why}); its sites start with current scaling")
    if cfg.finetune:
        return 0, 0
    if want_optim:
        if optim_state is None or ckpt.scheduler is None:
            raise CheckpointError(f"--load {root}: the {what} holds no optimizer state; use --no-load-optim or "
                                  "--finetune")
        try:
            optimizer.load_state_dict(optim_state)
        except (ValueError, KeyError, RuntimeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckpointError(f"--load {root}: the {what}'s optimizer state does not fit this run's optimizer: "
                                  f"{first}") from exc
        scheduler.load_state_dict(ckpt.scheduler)
    if want_rng:
        if rng is not None:
            tensor_parallel.set_all_rng_states(rng)
        elif resharded:
            _print0(f"RNG state not restored: it belongs to the saved layout ({saved}); dropout and sampling "
                    "draw fresh streams from --seed")
        elif fmt == "torch_dist":
            _print0(f"RNG state not restored: the {what} holds none; dropout and sampling draw fresh streams "
                    "from --seed")
        else:
            raise CheckpointError(f"--load {root}: the {what} holds no RNG state; use --no-load-rng")
    return int(ckpt.iteration), int(ckpt.consumed_samples)


def latest_iteration(root: Optional[str]) -> Optional[int]:
    """The tracker's iteration, or None when ``root`` holds no tracker (no checkpoint yet)."""
    return read_tracker(root) if cio.has_tracker(root) else None
