"""Our own checkpoint folders (``megatron/training/checkpointing.py`` writes them): read all ranks, write any
TP/PP layout. Files hold plain types only and load with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from megatron.core.checkpoint_formats import optimizer_state as optim
from megatron.core.checkpoint_formats.common import (FILE, SPEC_KEY, LoadedCheckpoint, atomic_save, chunk_keys,
                                                     model_chunks, rank_dir, rank_files, read_tracker,
                                                     saved_vocab_size, spec_from_saved, write_tracker)
from megatron.core.model_spec import spec_from_args, spec_to_args
from megatron.core.checkpoint_formats.layout import ModelDims
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError, describe_load_error

CHECKPOINT_VERSION = 3.0


def read_our_checkpoint(root: str, load_optim: bool = True, load_rng: bool = True,
                        iteration: Optional[int] = None) -> LoadedCheckpoint:
    """Every rank of one of our checkpoint folders (see :class:`LoadedCheckpoint`); ``extra`` holds the optimizer
    by parameter name (``optimizer_by_name``) for resharding. ``iteration``: read that one instead of the
    tracker's (a fallback to an older intact checkpoint)."""
    if iteration is None:
        iteration, iter_dir = read_tracker(root)
    else:
        iter_dir = os.path.join(root, f"iter_{iteration:07d}")
    files = rank_files(iter_dir)
    models, optimizers, named, rngs = {}, {}, {}, {}
    first = None
    for rank, path in sorted(files.items()):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointFormatError(
                f"{describe_load_error(path, exc)}; a Megatron-LM checkpoint is read with --loader megatron") from exc
        if not isinstance(state.get("args"), dict):
            raise CheckpointFormatError(f"{path}: 'args' is not a plain dict; not one of our checkpoints")
        first = first or state
        chunks = model_chunks(state, path)
        models[rank] = chunks
        if load_optim and state.get("optimizer") is not None:
            n, meta = optim.ours_to_named(state["optimizer"], chunks, path)
            named[rank] = (n, meta)
            optimizers[rank] = state["optimizer"]
        if load_rng and state.get("rng_state") is not None:
            rngs[rank] = state["rng_state"]
    extra = {"format": "ours", "optimizer_by_name": named or None, "iter_dir": iter_dir,
             "fp8_delayed_scaling": first.get("fp8_delayed_scaling")}
    sched = first.get("opt_param_scheduler") if load_optim else None
    return LoadedCheckpoint(models, optimizers or None, sched, rngs or None, int(first.get("iteration", iteration)),
                            int(first.get("consumed_train_samples", 0)),
                            with_derived_sizes(first["args"], models, first.get(SPEC_KEY)), extra)


def with_derived_sizes(args: Dict[str, Any], models, spec: Optional[dict] = None) -> Dict[str, Any]:
    """The saved arguments, completed with the stored model description (``model_spec``, when the checkpoint has
    one) and with what the trainer's typed configuration does not store: the padded vocabulary (the word
    embedding's rows times the TP size) and ``layernorm_epsilon`` (stored as ``norm_epsilon``). Arguments of older
    checkpoints, which hold both, are returned unchanged."""
    out = dict(args)
    if spec is not None:
        out[SPEC_KEY] = dict(spec)
    if out.get("layernorm_epsilon") is None and out.get("norm_epsilon") is not None:
        out["layernorm_epsilon"] = out["norm_epsilon"]
    if out.get("padded_vocab_size") is None:
        tp = 1 + max(t for t, _ in models)
        rows = [tensor.shape[0] for (t, _), chunks in models.items() if t == 0 for chunk in chunks
                for name, tensor in chunk.items() if name.endswith("word_embeddings.weight")]
        if rows:
            out["padded_vocab_size"] = rows[0] * tp
    return out


def our_args(args: Dict[str, Any], dims: ModelDims, tp: int, pp: int) -> Dict[str, Any]:
    """Saved arguments (plain types) updated with the model's sizes and the written layout; the options of a stored
    model description are carried over as flags."""
    out = spec_to_args(spec_from_saved(args)) if isinstance(args.get(SPEC_KEY), dict) else {}
    out.update({k: v for k, v in args.items() if v is None or isinstance(v, (bool, int, float, str, list))})
    out.update(num_layers=dims.num_layers, hidden_size=dims.hidden_size, ffn_hidden_size=dims.ffn_hidden_size,
               num_attention_heads=dims.num_attention_heads, max_position_embeddings=dims.max_position_embeddings,
               seq_length=dims.seq_length or dims.max_position_embeddings, padded_vocab_size=dims.padded_for(tp),
               make_vocab_size_divisible_by=dims.make_vocab_size_divisible_by,
               layernorm_epsilon=dims.layernorm_epsilon, apply_layernorm_1p=dims.apply_layernorm_1p,
               untie_embeddings_and_output_weights=not dims.tied_embeddings, params_dtype=dims.params_dtype,
               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if dims.vocab_size is not None:
        out["vocab_size"] = saved_vocab_size(out, dims)
    return out


def write_our_checkpoint(root: str, model_state_per_rank, dims: ModelDims, args: Dict[str, Any],
                         iteration: int = 0, consumed_samples: int = 0, optimizer_by_name=None,
                         scheduler: Optional[dict] = None, rng=None, release: bool = False,
                         optimizer_kind: Optional[str] = None) -> list:
    """Write ``{(tp, pp): [chunks]}`` (with ``{(tp, pp): (named, meta)}`` optimizer state and ``{(tp, pp): rng}``
    when given) as our checkpoint folder; the tracker file is written last. ``optimizer_kind`` ("fp32", "mixed",
    "distributed") picks our optimizer wrapper's layout (default: the source's). Returns the files written."""
    tp = 1 + max(t for t, _ in model_state_per_rank)
    pp = 1 + max(p for _, p in model_state_per_rank)
    plain = our_args(args, dims, tp, pp)
    written = []
    for (t, p), chunks in sorted(model_state_per_rank.items()):
        state: Dict[str, Any] = {"args": plain, SPEC_KEY: spec_from_args(plain).to_dict(),
                                 "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                                 "consumed_train_samples": consumed_samples}
        for key, c in zip(chunk_keys(len(chunks)), chunks):
            state[key] = {n: v.contiguous() for n, v in c.items()}
        if optimizer_by_name is not None:
            named, meta = optimizer_by_name[(t, p)]
            state["optimizer"] = optim.named_to_ours(named, meta, chunks, kind=optimizer_kind)
            if scheduler is not None:
                state["opt_param_scheduler"] = scheduler
        if rng is not None and (t, p) in rng:
            state["rng_state"] = rng[(t, p)]
        path = os.path.join(rank_dir(root, iteration, t, p, pp, release), FILE)
        atomic_save(state, path)
        written.append(path)
    write_tracker(root, iteration, release)
    return written
