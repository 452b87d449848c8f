"""Read this framework's training checkpoints for inference, at any tensor-parallel size, as one pipeline stage.

A checkpoint directory holds ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/mp_rank_TT[_PPP]/
model_optim_rng.pt`` (``release/`` when the tracker says ``release``). Every file loads with
``torch.load(weights_only=True)``; the training arguments are stored in it as a plain dict, and the model is
rebuilt from them, so inference needs no model flags.

The pipeline stages of the checkpoint are joined into one model (layer numbers shifted by each stage's offset,
the tied copy of the output weight on the last stage dropped). When the checkpoint's tensor-parallel size equals
the one asked for, each rank reads only its own files; otherwise the shards are concatenated along each
parameter's partition dimension and re-split for the asked size.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megatron.core.checkpoint_formats.safe_load import describe_load_error
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.transformer.config import TransformerConfig

TRACKER = "latest_checkpointed_iteration.txt"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class CheckpointLoadError(RuntimeError):
    """A checkpoint that cannot be used for inference; the message names the file and the reason."""


@dataclass
class LoadedModel:
    model: GPTModel
    args: dict  # the training arguments stored in the checkpoint
    iteration: int
    path: str  # the iteration directory read


def resolve_iteration_dir(load: str, iteration: Optional[int] = None) -> tuple:
    """``(iteration, directory)`` of the checkpoint to read: the tracker's unless ``iteration`` is given."""
    if not os.path.isdir(load):
        raise CheckpointLoadError(f"--load {load}: no such directory")
    if iteration is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            raise CheckpointLoadError(f"--load {load}: no {TRACKER} (not a checkpoint directory?)")
        text = open(tracker).read().strip()
        if text == "release":
            return 0, os.path.join(load, "release")
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointLoadError(f"{tracker}: expected an iteration number, found {text!r}") from None
    path = os.path.join(load, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise CheckpointLoadError(f"checkpoint directory {path} does not exist")
    return iteration, path


def _rank_file(it_dir: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return os.path.join(it_dir, name, "model_optim_rng.pt")


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointLoadError(f"checkpoint file {path} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated file, foreign pickle, not a zip
        raise CheckpointLoadError(describe_load_error(path, exc)) from exc
    if not isinstance(state, dict) or not isinstance(state.get("args"), dict):
        raise CheckpointLoadError(f"{path} holds no plain 'args' dict (not a checkpoint of this framework?)")
    return state


def _stage_state(state: dict, args: dict, pp_rank: int, path: str) -> Dict[str, torch.Tensor]:
    """The model entries of one pipeline stage's file, with layer numbers made global."""
    pp = int(args.get("pipeline_model_parallel_size", 1) or 1)
    vpp = args.get("virtual_pipeline_model_parallel_size")
    chunks = ["model"] if "model" in state else [f"model{v}" for v in range(int(vpp or 1))]
    out: Dict[str, torch.Tensor] = {}
    for v, key in enumerate(chunks):
        if key not in state:
            raise CheckpointLoadError(f"{path} has no '{key}' entry")
        offset, _ = layers_for_stage(int(args["num_layers"]), pp, pp_rank, vpp_size=vpp if len(chunks) > 1 else None,
                                     vpp_rank=v, first_stage_layers=args.get("decoder_first_pipeline_num_layers"),
                                     last_stage_layers=args.get("decoder_last_pipeline_num_layers"))
        for name, tensor in state[key].items():
            if name.endswith("._extra_state"):
                continue
            name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
            out[name] = tensor
    return out


def _join_stages(it_dir: str, args: dict, tp_rank: int) -> Dict[str, torch.Tensor]:
    pp = int(args.get("pipeline_model_parallel_size", 1) or 1)
    tied = not args.get("untie_embeddings_and_output_weights", False)
    merged: Dict[str, torch.Tensor] = {}
    for p in range(pp):
        path = _rank_file(it_dir, tp_rank, p, pp)
        stage = _stage_state(_read(path), args, p, path)
        for name, tensor in stage.items():
            if tied and name == "output_layer.weight" and pp > 1:
                continue  # the last stage's copy of the tied word embedding
            merged[name] = tensor
    return merged


def _first_set(args: dict, *keys: str, default):
    """The value of the first key that is set: older checkpoints store ``layernorm_epsilon``, the typed
    configuration ``norm_epsilon`` (and, for now, both)."""
    for key in keys:
        if args.get(key) is not None:
            return args[key]
    return default


def config_from_args(args: dict, dtype: Optional[torch.dtype] = None,
                     attention_backend: str = "sdpa") -> TransformerConfig:
    """An inference configuration (no dropout, no recomputation, no sequence parallelism) from stored args."""
    need = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    missing = [k for k in need if args.get(k) is None]
    if missing:
        raise CheckpointLoadError(f"checkpoint args lack {', '.join(missing)}")
    if dtype is None:
        dtype = _DTYPES.get(str(args.get("params_dtype", "float32")), torch.float32)
    return TransformerConfig(
        num_layers=int(args["num_layers"]), hidden_size=int(args["hidden_size"]),
        num_attention_heads=int(args["num_attention_heads"]), ffn_hidden_size=args.get("ffn_hidden_size"),
        seq_length=int(args["seq_length"]), max_position_embeddings=args.get("max_position_embeddings"),
        padded_vocab_size=int(args["padded_vocab_size"]), attention_dropout=0.0, hidden_dropout=0.0,
        layernorm_epsilon=float(_first_set(args, "layernorm_epsilon", "norm_epsilon", default=1e-5)),
        layernorm_zero_centered_gamma=bool(args.get("apply_layernorm_1p", False)), params_dtype=dtype,
        share_embeddings_and_output_weights=not args.get("untie_embeddings_and_output_weights", False),
        attention_backend=attention_backend, gradient_accumulation_fusion=False,
    )


def load_gpt_for_inference(load: str, pstate: Optional[ParallelState] = None, iteration: Optional[int] = None,
                           dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                           attention_backend: str = "sdpa") -> LoadedModel:
    """Build this rank's part of the GPT stored under ``load``, at ``pstate``'s TP and PP sizes (any, whatever the
    checkpoint's), in eval mode. Layers are split evenly over the pipeline stages."""
    pstate = pstate or ParallelState.single()
    iteration, it_dir = resolve_iteration_dir(load, iteration)
    single = _rank_file(it_dir, 0, 0, 1)
    first = _read(single if os.path.isfile(single) else _rank_file(it_dir, 0, 0, 2))
    args = dict(first["args"])
    saved_tp = int(args.get("tensor_model_parallel_size", 1) or 1)
    if args.get("padded_vocab_size") is None:
        emb = first.get("model", first.get("model0", {})).get("embedding.word_embeddings.weight")
        if emb is None:
            raise CheckpointLoadError(f"{it_dir}: args lack padded_vocab_size and the first stage has no embedding")
        args["padded_vocab_size"] = emb.shape[0] * saved_tp
    config = config_from_args(args, dtype, attention_backend)
    if config.padded_vocab_size % pstate.tp_size or config.num_attention_heads % pstate.tp_size:
        raise CheckpointLoadError(f"tensor-parallel size {pstate.tp_size} divides neither the padded vocabulary "
                                  f"{config.padded_vocab_size} nor {config.num_attention_heads} heads evenly")
    if config.num_layers % pstate.pp_size:
        raise CheckpointLoadError(f"pipeline size {pstate.pp_size} does not divide {config.num_layers} layers")
    offset, count = layers_for_stage(config.num_layers, pstate.pp_size, pstate.pp_rank)
    # built on default_device(); the weights are loaded below
    model = GPTModel(config, pstate, pre_process=pstate.is_pipeline_first_stage,
                     post_process=pstate.is_pipeline_last_stage, num_layers=count, layer_offset=offset)
    tied = config.share_embeddings_and_output_weights

    def global_name(name: str) -> str:
        if tied and name == "output_layer.weight":  # the last stage's copy of the word embedding
            return "embedding.word_embeddings.weight"
        return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)

    same_tp = saved_tp == pstate.tp_size
    shards = [_join_stages(it_dir, args, t) for t in ([pstate.tp_rank] if same_tp else range(saved_tp))]
    state = {}
    for name, param in model.named_parameters():
        key = global_name(name)
        if key not in shards[0]:
            continue  # reported by load_state_dict below
        if same_tp or not getattr(param, "tensor_model_parallel", False):
            state[name] = shards[0][key]
        else:
            dim = param.partition_dim
            full = torch.cat([shard[key] for shard in shards], dim=dim)
            state[name] = full.chunk(pstate.tp_size, dim=dim)[pstate.tp_rank]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointLoadError(f"checkpoint {it_dir} does not fit the model built from its args: {exc}") from exc
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
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)
    if tp_rank == 0 and pp_rank == 0:
        tracker = os.path.join(root, TRACKER)
        with open(f"{tracker}.tmp.{os.getpid()}", "w") as f:
            f.write(str(iteration))
        os.replace(f"{tracker}.tmp.{os.getpid()}", tracker)
    return path
