"""Read a GPT training checkpoint for inference, at any tensor/pipeline-parallel size.

A checkpoint directory holds ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/mp_rank_TT[_PPP]/
model_optim_rng.pt`` (``release/`` when the tracker says ``release``). The files are read by the trainer's own
readers in ``megatron.core.checkpoint_formats``: ours (``torch.load(weights_only=True)``, arguments stored as a
plain dict), Megatron-LM's legacy files (also as our trainer writes them with ``--ckpt-layout megatron``: a pickled
``argparse.Namespace`` read through an allowlist of inert stand-ins) and Megatron-Core's ``torch_dist`` folders
(model weights only). The model is rebuilt from the stored model description (``model_spec``; for older and
Megatron-LM checkpoints, from the stored flags), so inference needs no model flags.

Every rank's file is read; when the saved layout differs from the asked one, ``state_for_rank`` reshards the
model (pipeline stages joined and split evenly again, tensor shards concatenated and re-split, the vocabulary
padded for the asked TP size as the trainer pads it). Only model weights are kept.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron.core import checkpoint_io as cio
from megatron.core.checkpoint_formats import (GPT, SPEC_KEY, CheckpointFormatError, LoadedCheckpoint,
                                              dims_from_args, load_megatron_file, read_megatron_checkpoint,
                                              read_our_checkpoint, spec_from_saved, state_for_rank)
from megatron.core.checkpoint_formats.common import rank_files
from megatron.core.checkpoint_formats.load_time import checkpoint_format
from megatron.core.checkpoint_formats.reshard import layout_of
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.transformer.config import TransformerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# A checkpoint that cannot be used for inference; the message names the file and the reason. The checkpoint
# folder's one error type, so the tracker's and the folder's errors are caught with the loader's own.
CheckpointLoadError = cio.CheckpointIOError


@dataclass
class LoadedModel:
    model: GPTModel
    args: dict  # the training arguments stored in the checkpoint
    iteration: int
    path: str  # the iteration directory read


def resolve_iteration_dir(load: str, iteration: Optional[int] = None) -> tuple:
    """``(iteration, directory)`` of the checkpoint to read: the tracker's unless ``iteration`` is given."""
    if iteration is None:
        iteration, path = cio.read_tracker(load)
        if iteration == 0:
            return 0, path
    else:
        path = cio.iteration_dir(load, iteration)
    if not os.path.isdir(path):
        raise CheckpointLoadError(f"checkpoint directory {path} does not exist")
    return iteration, path


def _rank_file(it_dir: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return os.path.join(it_dir, name, "model_optim_rng.pt")


def config_from_args(args: dict, dtype: Optional[torch.dtype] = None,
                     attention_backend: str = "sdpa") -> TransformerConfig:
    """An inference configuration (no dropout, no recomputation, no sequence parallelism) of the stored model: its
    ``model_spec`` (our checkpoints) or the model its stored flags describe (older and Megatron-LM checkpoints);
    ``padded_vocab_size`` in ``args`` gives the rows at the layout being built."""
    need = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    missing = [k for k in need if args.get(k) is None]
    if missing and not isinstance(args.get(SPEC_KEY), dict):
        raise CheckpointLoadError(f"checkpoint args lack {', '.join(missing)}")
    if dtype is None:
        dtype = _DTYPES.get(str(args.get("params_dtype", "float32")), torch.float32)
    spec = spec_from_saved(args)
    if args.get("padded_vocab_size") is not None:
        spec = dataclasses.replace(spec, padded_vocab_size=int(args["padded_vocab_size"]))
    try:
        config = TransformerConfig.from_spec(spec, attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype,
                                             attention_backend=attention_backend, gradient_accumulation_fusion=False)
        return config
    except ValueError as exc:
        raise CheckpointLoadError(f"the stored model: {exc}") from None


def _read_checkpoint(load: str, it_dir: str, iteration: Optional[int]) -> LoadedCheckpoint:
    """Every rank's model state of the checkpoint in ``it_dir``, read by the trainer's own readers: ours (plain
    ``torch.load(weights_only=True)``), Megatron-LM's legacy files (a pickled ``argparse.Namespace``, read through
    the allowlist of ``checkpoint_formats.safe_load``), or a Megatron-Core ``torch_dist`` folder (weights only)."""
    fmt = checkpoint_format(it_dir)
    try:
        if fmt is None:  # no readable rank file: say which file and why
            files = rank_files(it_dir)
            load_megatron_file(files[min(files)])
            raise CheckpointFormatError(f"{files[min(files)]} is not a checkpoint file of a known format")
        if fmt == "ours":
            for path in rank_files(it_dir).values():
                if torch.serialization.get_unsafe_globals_in_checkpoint(path):  # a pickled class: say which one
                    load_megatron_file(path)
            ckpt = read_our_checkpoint(load, load_optim=False, load_rng=False, iteration=iteration)
        else:
            ckpt = read_megatron_checkpoint(load, GPT, load_optim=False, load_rng=False, iteration=iteration)
    except CheckpointFormatError as exc:
        raise CheckpointLoadError(str(exc)) from exc
    except (OSError, RuntimeError) as exc:  # a file that vanished or broke while being read
        raise CheckpointLoadError(f"cannot read checkpoint {it_dir}: {type(exc).__name__}: "
                                  f"{(str(exc).splitlines() or [''])[0]}") from exc
    return ckpt


def _plain_args(ckpt: LoadedCheckpoint) -> dict:
    """The stored training arguments as a plain dict, with ``padded_vocab_size`` filled from the embedding rows
    when the arguments lack it."""
    args = dict(ckpt.args_dict)
    if args.get("padded_vocab_size") is None:
        src_tp = layout_of(ckpt.model_state_per_rank)[0]
        emb = ckpt.model_state_per_rank[(0, 0)][0].get("embedding.word_embeddings.weight")
        if emb is None:
            raise CheckpointLoadError(f"{ckpt.extra.get('iter_dir')}: args lack padded_vocab_size and the first "
                                      "stage has no embedding")
        args["padded_vocab_size"] = emb.shape[0] * src_tp
    return args


def load_gpt_for_inference(load: str, pstate: Optional[ParallelState] = None, iteration: Optional[int] = None,
                           dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                           attention_backend: str = "sdpa") -> LoadedModel:
    """Build this rank's part of the GPT stored under ``load``, at ``pstate``'s TP and PP sizes (any, whatever the
    checkpoint's), in eval mode. The checkpoint may be ours, Megatron-LM's legacy one (also as our trainer writes
    it with ``--ckpt-layout megatron``) or Megatron-Core's ``torch_dist``; raises :class:`CheckpointLoadError` with
    one line naming the directory or file."""
    pstate = pstate or ParallelState.single()
    asked = iteration
    iteration, it_dir = resolve_iteration_dir(load, iteration)
    ckpt = _read_checkpoint(load, it_dir, asked)
    args = _plain_args(ckpt)
    try:
        dims = dims_from_args(args)
        src_tp, src_pp, src_vpp = layout_of(ckpt.model_state_per_rank)
        same = (src_tp, src_pp, src_vpp) == (pstate.tp_size, pstate.pp_size, 1)
        # resharding pads the vocabulary for the asked TP size as the trainer would; an unchanged layout keeps it
        padded = dims.padded_vocab_size if same else dims.padded_for(pstate.tp_size)
        args["padded_vocab_size"] = padded
        config = config_from_args(args, dtype, attention_backend)
        if config.num_attention_heads % pstate.tp_size:
            raise CheckpointLoadError(f"tensor-parallel size {pstate.tp_size} does not divide the "
                                      f"{config.num_attention_heads} attention heads of {it_dir}")
        first = args.get("decoder_first_pipeline_num_layers") if same else None
        last = args.get("decoder_last_pipeline_num_layers") if same else None
        try:
            offset, count = layers_for_stage(config.num_layers, pstate.pp_size, pstate.pp_rank,
                                             first_stage_layers=first, last_stage_layers=last)
        except ValueError as exc:
            raise CheckpointLoadError(f"pipeline size {pstate.pp_size} for {it_dir}: {exc}") from exc
        chunks, _, _ = state_for_rank(ckpt, dims, pstate.tp_size, pstate.pp_size, pstate.tp_rank, pstate.pp_rank)
    except CheckpointFormatError as exc:
        raise CheckpointLoadError(f"--load {load}: {exc}") from exc
    # built on default_device(); the weights are loaded below
    model = GPTModel(config, pstate, pre_process=pstate.is_pipeline_first_stage,
                     post_process=pstate.is_pipeline_last_stage, num_layers=count, layer_offset=offset)
    state = {k: v for k, v in chunks[0].items() if not k.endswith("_extra_state")}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = [ln for ln in lines[1:] if ln.startswith(("size mismatch", "Missing", "Unexpected"))]
        raise CheckpointLoadError(f"checkpoint {it_dir} does not fit the model built from its args: "
                                  f"{detail[0] if detail else lines[0]}") from exc
    if device is not None:
        model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return LoadedModel(model=model, args=args, iteration=iteration, path=it_dir)


def save_gpt_checkpoint(root: str, iteration: int, chunks: List[GPTModel], args: dict, tp_rank: int = 0,
                        pp_rank: int = 0) -> str:
    """Write one rank's model in the training checkpoint layout (model entries only) and the tracker.

    For tools and tests that produce a checkpoint without training; the trainer writes its own.
    """
    pp = int(args.get("pipeline_model_parallel_size", 1) or 1)
    path = _rank_file(os.path.join(root, f"iter_{iteration:07d}"), tp_rank, pp_rank, pp)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {"args": dict(args), "checkpoint_version": 3.0, "iteration": iteration}
    if len(chunks) == 1:
        state["model"] = chunks[0].state_dict()
    else:
        state.update({f"model{i}": c.state_dict() for i, c in enumerate(chunks)})
    cio.save_torch(state, os.path.dirname(path), os.path.basename(path))
    if tp_rank == 0 and pp_rank == 0:
        cio.write_tracker(root, iteration)
    return path
