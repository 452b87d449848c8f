"""Megatron-LM's legacy ``--ckpt-format torch`` checkpoints: read them into our layouts, write them from ours.

Facts of the format (Megatron-LM with Megatron-Core models): one ``model_optim_rng.pt`` per model-parallel rank in
``iter_NNNNNNN/mp_rank_TT[_PPP]/``; ``args`` is a pickled ``argparse.Namespace`` that also holds
``consumed_train_samples``; each linear layer and ``output_layer`` add an ``_extra_state`` entry (``None`` for the
local layer spec); the optimizer is the torch optimizer's state dict (fp32) or ``{optimizer, fp32_from_fp16_params
[per group], grad_scaler (fp16 only)}`` (bf16/fp16) in Megatron-Core's parameter order; ``opt_param_scheduler``
counts samples; ``rng_state`` is a list with one dict per data-parallel rank; ``num_floating_point_operations_so_far``
is top level. The distributed optimizer's ``distrib_optim.pt`` is read by ``distrib_optim.py``; ``torch_dist``
checkpoints by ``megatron_dist.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core.checkpoint_formats import optimizer_state as optim
from megatron.core.checkpoint_formats.common import (FILE, SPEC_KEY, LoadedCheckpoint, atomic_save, chunk_keys,
                                                     model_chunks, rank_dir, rank_files, read_tracker,
                                                     saved_vocab_size, spec_from_saved, to_family_order,
                                                     write_tracker)
from megatron.core.checkpoint_formats.distrib_optim import (distributed_optimizer_groups, hyper_from_distributed,
                                                             own_bucket_names, read_distrib_optim,
                                                             write_distrib_optim)
from megatron.core.checkpoint_formats.layout import GPT, ModelDims, ModelFamily, check_supported_args
from megatron.core.checkpoint_formats.megatron_precore import core_view
from megatron.core.checkpoint_formats.megatron_state import (rng_from_megatron, rng_to_megatron,
                                                             scheduler_from_megatron, scheduler_to_megatron)
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError, load_megatron_file, to_plain
from megatron.core.model_spec import spec_to_args

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
    per_key = read_distrib_optim(distrib, mg_chunks, args, rank[1], own_bucket_names(args, family))
    hyper, step = hyper_from_distributed(opt_sd, where)
    meta = {"kind": "distributed", "param_groups": hyper, "step": step, "grad_scaler": opt_sd.get("grad_scaler")}
    return optim.named_from_keys(plain_mg, per_key), meta


# ---- read ---------------------------------------------------------------------------------------------------------
def read_megatron_checkpoint(root: str, family: ModelFamily = GPT, load_optim: bool = True,
                             load_rng: bool = True, iteration: Optional[int] = None,
                             num_attention_heads: Optional[int] = None) -> LoadedCheckpoint:
    """Read a Megatron-LM legacy checkpoint folder (any TP/PP) into our layouts.

    Returns ``(model_state_per_rank, optimizer, scheduler, rng, iteration, consumed_samples, args_dict, extra)``:
    model state dicts without ``_extra_state`` (our module order), our trainer's optimizer state dicts (same
    precision wrapper, our parameter order), our scheduler state (iterations), our RNG state per rank.
    A ``torch_dist`` folder is read by ``megatron_dist.read_torch_dist_checkpoint``.
    ``iteration``: read that one instead of the tracker's (a fallback to an older intact checkpoint);
    ``num_attention_heads``: the model's, for a pre-Core file that stores no arguments."""
    if iteration is None:
        iteration, iter_dir = read_tracker(root)
    else:
        iter_dir = os.path.join(root, f"iter_{iteration:07d}")
    if os.path.isfile(os.path.join(iter_dir, ".metadata")):  # torch_dist
        from megatron.core.checkpoint_formats.megatron_dist import read_torch_dist_checkpoint

        return read_torch_dist_checkpoint(root, family, load_optim=load_optim, load_rng=load_rng,
                                          iteration=iteration)
    files = rank_files(iter_dir)
    models, optimizers, named, rngs, fp8 = {}, {}, {}, {}, {}
    sched_raw, args, first = None, None, None
    for rank, path in sorted(files.items()):
        state = load_megatron_file(path)
        if isinstance(state, dict):  # a pre-Core file: its weights under Core names (megatron_precore.py)
            state = core_view(state, family, 1 + max(t for t, _ in files), num_attention_heads, path)
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
        if state.get("fp8_delayed_scaling") is not None:  # our trainer's extra entry (--fp8-recipe delayed)
            fp8[rank] = state["fp8_delayed_scaling"]
    where = files[min(files)]
    consumed = int(args.get("consumed_train_samples") or 0)
    sched = scheduler_from_megatron(sched_raw, args, where) if (load_optim and sched_raw) else None
    extra = {"format": "megatron", "megatron_scheduler": sched_raw, "optimizer_by_name": named or None,
             "checkpoint_version": first.get("checkpoint_version"),
             "num_floating_point_operations_so_far": first.get("num_floating_point_operations_so_far"),
             "iter_dir": iter_dir, "fp8_delayed_scaling": fp8 or None}
    return LoadedCheckpoint(models, optimizers or None, sched, rngs or None, int(first.get("iteration", iteration)),
                            consumed, args, extra)


# ---- write --------------------------------------------------------------------------------------------------------
def megatron_model_state(chunk: Dict[str, torch.Tensor], family: ModelFamily) -> Dict[str, Any]:
    """Our chunk state dict as Megatron-Core writes it: its module order and ``_extra_state`` entries."""
    ordered = to_family_order(chunk, family, megatron=True)
    out: Dict[str, Any] = {}
    extra_layer = set(family.megatron_extra_state_layer)
    names = list(ordered)
    for i, (name, value) in enumerate(ordered.items()):
        out[name] = value
        index, rel = family.split_layer_name(name)
        module = name.rsplit(".", 1)[0]
        last_of_module = i + 1 == len(names) or names[i + 1].rsplit(".", 1)[0] != module  # bias, or weight alone
        if index is not None and last_of_module and rel.rsplit(".", 1)[0] in extra_layer:
            out[module + "._extra_state"] = None
    last = any(n in family.last_stage for n in ordered)
    if last:
        for module in family.megatron_extra_state_global:
            out[f"{module}._extra_state"] = None
    return out


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Megatron-LM's param-group fields its trainer and scheduler read (``get_megatron_optimizer`` sets them)
_GROUP_DEFAULTS = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0, "is_decoupled_lr": False}


def megatron_param_groups(groups, scheduler: Optional[dict] = None) -> list:
    """The two param groups' hyperparameters (weight-decayed first) with the fields Megatron-LM's own groups carry:
    ``wd_mult`` 1 and 0, ``lr_mult``, ``max_lr``/``min_lr`` (from our scheduler), the expert/decoupled flags."""
    out = []
    for index, group in enumerate(groups):
        g = dict(group)
        for key, value in _GROUP_DEFAULTS.items():
            g.setdefault(key, value)
        g.setdefault("wd_mult", 1.0 if index == 0 else 0.0)
        if scheduler is not None:
            g.setdefault("max_lr", scheduler["max_lr"])
            g.setdefault("min_lr", scheduler["min_lr"])
        out.append(g)
    return out


def megatron_args(args: Dict[str, Any], dims: ModelDims, tp: int, pp: int, consumed: int, iteration: int,
                  vpp: Optional[int] = None, distributed_optimizer: bool = False,
                  **extra: Any) -> argparse.Namespace:
    """An ``argparse.Namespace`` of the run's flags as Megatron-LM saves them: the model sizes and layout it checks
    on resume (``check_checkpoint_args``), ``consumed_train_samples``; ``extra`` adds or overrides fields."""
    plain = {k: v for k, v in args.items() if not (isinstance(v, str) and v.startswith(("ModelType.", "AttnBackend.")))}
    # the model as the arguments describe it (a stored spec, or the flags), with the sizes of the model written
    sizes = dict(num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_attention_heads,
                 ffn_hidden_size=dims.ffn_hidden_size, max_position_embeddings=dims.max_position_embeddings,
                 seq_length=dims.seq_length or dims.max_position_embeddings, norm_epsilon=dims.layernorm_epsilon,
                 apply_layernorm_1p=dims.apply_layernorm_1p,
                 untie_embeddings_and_output_weights=not dims.tied_embeddings)
    spec = dataclasses.replace(spec_from_saved({**args, **sizes}), padded_vocab_size=dims.padded_for(tp))
    plain.pop(SPEC_KEY, None)
    plain.update(spec_to_args(spec))
    plain.update(
        make_vocab_size_divisible_by=dims.make_vocab_size_divisible_by,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if (vpp or 1) > 1 else None, consumed_train_samples=consumed,
        consumed_valid_samples=int(args.get("consumed_valid_samples") or 0), iteration=iteration,
        params_dtype=_DTYPES.get(dims.params_dtype, torch.float32), bf16=dims.params_dtype == "bfloat16",
        fp16=dims.params_dtype == "float16", ckpt_format="torch", use_dist_ckpt=False,
        use_distributed_optimizer=distributed_optimizer)
    if dims.vocab_size is not None:
        plain["vocab_size"] = saved_vocab_size(plain, dims)
    plain.update(extra)
    return argparse.Namespace(**plain)


def grad_scaler_to_megatron(state: Optional[dict]) -> Optional[dict]:
    """Our fp16 loss scaler's state as Megatron-LM's ``DynamicGradScaler`` keeps it (``scale`` a one-element
    tensor, which its ``load_state_dict`` moves to the GPU); our scalers read either form back."""
    if state is None:
        return None
    out = {"scale": torch.tensor([float(state["scale"])], dtype=torch.float32)}
    for key in ("growth_tracker", "hysteresis_tracker"):
        if key in state:
            out[key] = int(state[key])
    return out


def megatron_rank_state(chunks, ns: argparse.Namespace, family: ModelFamily = GPT, optimizer_by_name=None,
                        scheduler: Optional[dict] = None, rng: Optional[dict] = None,
                        num_floating_point_operations_so_far: float = 0.0,
                        pp_rank: int = 0) -> Tuple[dict, Optional[dict]]:
    """``(model_optim_rng.pt state, distrib_optim.pt state or None)`` of one model-parallel rank in Megatron-LM's
    layout; ``chunks``: its model chunk state dicts (our names); ``optimizer_by_name``: its ``(named, meta)``;
    ``scheduler``: ours (iterations); ``rng``: ours. With ``ns.use_distributed_optimizer`` the optimizer's tensors
    go to the second file (``distrib_optim.py``), the param groups to the first, as Megatron-LM's distributed
    optimizer saves them; otherwise the non-distributed layout (fp32, or ``fp32_from_fp16_params``)."""
    args = to_plain(ns)
    mg_chunks = [megatron_model_state(c, family) for c in chunks]
    state: Dict[str, Any] = {"args": ns, "checkpoint_version": CHECKPOINT_VERSION, "iteration": int(ns.iteration),
                             "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
    for key, c in zip(chunk_keys(len(chunks)), mg_chunks):
        state[key] = c
    distrib = None
    if optimizer_by_name is not None:
        named, meta = optimizer_by_name
        meta = dict(meta, param_groups=megatron_param_groups(meta["param_groups"], scheduler),
                    grad_scaler=grad_scaler_to_megatron(meta.get("grad_scaler")))
        plain_mg = [to_family_order(c, family, megatron=True) for c in chunks]
        if ns.use_distributed_optimizer:
            per_key = {(c, n): e for c, chunk in enumerate(optim.with_main_params(named, plain_mg))
                       for n, e in chunk.items()}
            own = own_bucket_names(args, family)
            distrib = write_distrib_optim(mg_chunks, per_key, args, pp_rank, own)
            state["optimizer"] = distributed_optimizer_groups(meta)
        else:
            state["optimizer"] = optim.named_to_megatron(named, meta, plain_mg,
                                                         mixed_precision=args.get("params_dtype") != "float32")
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler_to_megatron(scheduler, args)
    if rng is not None:
        state["rng_state"] = rng_to_megatron(rng)
    return state, distrib


def write_megatron_checkpoint(root: str, model_state_per_rank, dims: ModelDims, args: Dict[str, Any],
                              iteration: int = 0, consumed_samples: int = 0, family: ModelFamily = GPT,
                              optimizer_by_name=None, scheduler: Optional[dict] = None, rng=None,
                              release: bool = False, num_floating_point_operations_so_far: float = 0.0) -> list:
    """Write ``model_state_per_rank`` (our names, ``{(tp, pp): [chunks]}``) as a Megatron-LM legacy checkpoint
    (non-distributed optimizer layout).

    ``optimizer_by_name``: ``{(tp, pp): (named, meta)}`` for the same layout (see ``optimizer_state``);
    ``scheduler``: ours (iterations); ``rng``: ``{(tp, pp): ours}``. Returns the files written."""
    tp = 1 + max(t for t, _ in model_state_per_rank)
    pp = 1 + max(p for _, p in model_state_per_rank)
    vpp = max(len(chunks) for chunks in model_state_per_rank.values())
    written = []
    for (t, p), chunks in sorted(model_state_per_rank.items()):
        ns = megatron_args(args, dims, tp, pp, consumed_samples, iteration, vpp=vpp)
        state, _ = megatron_rank_state(
            chunks, ns, family, optimizer_by_name[(t, p)] if optimizer_by_name is not None else None,
            scheduler, rng.get((t, p)) if rng is not None else None, num_floating_point_operations_so_far, p)
        path = os.path.join(rank_dir(root, iteration, t, p, pp, release), FILE)
        atomic_save(state, path)
        written.append(path)
    write_tracker(root, iteration, release)
    return written
