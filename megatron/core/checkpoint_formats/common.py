"""Pieces shared by the readers and writers: the checkpoint directory layout, the loaded-checkpoint record, the
model sizes from saved arguments, and crash-safe writing."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron.core import checkpoint_io
from megatron.core.checkpoint_formats.layout import ModelDims, ModelFamily
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError
from megatron.core.model_spec import ModelSpec, spec_from_args

SPEC_KEY = "model_spec"  # our checkpoints: the model's ModelSpec as a plain dict, next to "args"

FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


class LoadedCheckpoint(NamedTuple):
    """Everything a checkpoint folder holds, per ``(tp_rank, pp_rank)`` where it is per rank, in our layouts.

    ``model_state_per_rank``: ``{(tp, pp): [chunk state dict, ...]}``; ``optimizer``: ``{(tp, pp): our trainer's
    optimizer state dict}`` or ``None``; ``scheduler``: our scheduler state (steps in iterations) or ``None``;
    ``rng``: ``{(tp, pp): our RNG state}`` or ``None``; ``args_dict``: the saved arguments as plain types;
    ``extra``: format-specific facts (e.g. Megatron-LM's sample-based scheduler state, the optimizer by name)."""

    model_state_per_rank: Dict[Tuple[int, int], List[Dict[str, torch.Tensor]]]
    optimizer: Optional[Dict[Tuple[int, int], dict]]
    scheduler: Optional[dict]
    rng: Optional[Dict[Tuple[int, int], dict]]
    iteration: int
    consumed_samples: int
    args_dict: Dict[str, Any]
    extra: Dict[str, Any] = {}


def read_tracker(root: str) -> Tuple[int, str]:
    """``(iteration, iteration folder)`` named by the tracker (``release``: 0); see ``checkpoint_io``."""
    return checkpoint_io.read_tracker(root, flag="--load-dir")


def rank_files(iter_dir: str) -> Dict[Tuple[int, int], str]:
    """``{(tp_rank, pp_rank): path of model_optim_rng.pt}`` of an iteration folder."""
    if not os.path.isdir(iter_dir):
        raise CheckpointFormatError(f"checkpoint folder {iter_dir} named by the tracker does not exist")
    out = {}
    for name in sorted(os.listdir(iter_dir)):
        path = os.path.join(iter_dir, name)
        if not os.path.isdir(path):
            continue
        m = _RANK_DIR.match(name)
        if not m:
            if name.startswith("mp_rank_"):
                raise CheckpointFormatError(f"{path}: rank folder layout {name} (expert parallelism?) is not "
                                            "supported; expected mp_rank_TT or mp_rank_TT_PPP")
            continue
        if not os.path.isfile(os.path.join(path, FILE)):
            raise CheckpointFormatError(f"{path} has no {FILE}")
        out[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(path, FILE)
    if not out:
        names = os.listdir(iter_dir)
        if any(n.endswith(".distcp") for n in names):
            raise CheckpointFormatError(f"{iter_dir} holds torch_dist data files but no .metadata: an incomplete "
                                        "torch_dist checkpoint")
        raise CheckpointFormatError(f"{iter_dir} holds no mp_rank_TT[_PPP]/{FILE}")
    return out


def rank_dir(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int, release: bool = False) -> str:
    it = "release" if release else f"iter_{iteration:07d}"
    rank = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return os.path.join(root, it, rank)


def model_chunks(state: dict, path: str) -> List[Dict[str, torch.Tensor]]:
    """The model state dict(s) of one file: ``model`` or ``model0``, ``model1``, ... (virtual pipeline)."""
    if "model" in state:
        return [state["model"]]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not keys:
        raise CheckpointFormatError(f"{path} holds no model state ('model' or 'model0', ...)")
    return [state[k] for k in keys]


def chunk_keys(n: int) -> List[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def atomic_save(obj, path: str) -> None:
    """``torch.save`` durably (temporary name, fsync, rename; ``checkpoint_io.save_torch``)."""
    checkpoint_io.save_torch(obj, os.path.dirname(path), os.path.basename(path))


def write_tracker(root: str, iteration: int, release: bool) -> None:
    """Once every rank's file is written: the folder's manifest, then the tracker (``checkpoint_io``'s order)."""
    checkpoint_io.write_folder_manifest(checkpoint_io.iteration_dir(root, iteration, release), iteration)
    checkpoint_io.write_tracker(root, iteration, release)


def spec_from_saved(args: Dict[str, Any]) -> ModelSpec:
    """The model description of a checkpoint's saved arguments: the stored spec (``model_spec``, our checkpoints)
    or, for older checkpoints and Megatron-LM's, the one their flags describe."""
    try:
        if isinstance(args.get(SPEC_KEY), dict):
            return ModelSpec.from_dict(args[SPEC_KEY])
        return spec_from_args(args)
    except (TypeError, ValueError) as exc:
        raise CheckpointFormatError(f"the checkpoint's model description: {exc}") from None


def dims_from_args(args: Dict[str, Any], full: Optional[Dict[str, torch.Tensor]] = None,
                   vocab_size: Optional[int] = None) -> ModelDims:
    """Model sizes from saved arguments (Megatron-LM's or ours); ``full`` fills what the arguments omit.

    ``vocab_size`` is the real vocabulary (default: the arguments' ``vocab_size``); when known, the padding at any
    TP size follows Megatron's rule, as the trainer computes it from the tokenizer."""
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if args.get(k) is None]
    if missing and not isinstance(args.get(SPEC_KEY), dict):
        raise CheckpointFormatError(f"the checkpoint's saved arguments lack {missing[0]}")
    spec = spec_from_saved(args)
    padded = args.get("padded_vocab_size") or spec.padded_vocab_size
    if not padded and full is not None:
        padded = full["embedding.word_embeddings.weight"].shape[0]
    if not padded:
        raise CheckpointFormatError("the checkpoint's saved arguments lack padded_vocab_size")
    if vocab_size is None and args.get("vocab_size"):  # Megatron-LM's --vocab-size (tokenizers without files)
        vocab_size = int(args["vocab_size"])
        if args.get("tokenizer_type") == "NullTokenizer" and int(padded) > vocab_size:
            vocab_size += 1  # NullTokenizer's ids 0..N-1 and its end-of-document id N (when the rows hold it)
    dtype = args.get("params_dtype")
    if dtype is None:
        dtype = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"
    return dims_from_spec(spec, padded_vocab_size=int(padded), vocab_size=vocab_size,
                          make_vocab_size_divisible_by=int(args.get("make_vocab_size_divisible_by") or 128),
                          params_dtype=str(dtype).replace("torch.", ""), seq_length=args.get("seq_length"))


def saved_vocab_size(args: Dict[str, Any], dims: ModelDims) -> Optional[int]:
    """The ``vocab_size`` argument to save for ``dims``' real vocabulary: Megatron-LM's ``NullTokenizer`` counts its
    ``--vocab-size`` without the end-of-document row it adds (the reverse of :func:`dims_from_args`'s rule)."""
    if dims.vocab_size is None:
        return None
    return dims.vocab_size - 1 if args.get("tokenizer_type") == "NullTokenizer" else dims.vocab_size


def dims_from_spec(spec: ModelSpec, padded_vocab_size: Optional[int] = None, vocab_size: Optional[int] = None,
                   make_vocab_size_divisible_by: int = 128, params_dtype: str = "float32",
                   seq_length: Optional[int] = None) -> ModelDims:
    """The sizes of the model ``spec`` describes, with what a checkpoint conversion adds: the real vocabulary (when
    known), the padding rule and the dtype. ``seq_length`` defaults to the spec's."""
    return ModelDims(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size, max_position_embeddings=spec.max_position_embeddings,
        padded_vocab_size=int(padded_vocab_size or spec.padded_vocab_size), vocab_size=vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        seq_length=spec.seq_length if seq_length is None else seq_length, layernorm_epsilon=spec.layernorm_epsilon,
        apply_layernorm_1p=spec.layernorm_zero_centered_gamma,
        tied_embeddings=spec.share_embeddings_and_output_weights, params_dtype=params_dtype,
        num_query_groups=spec.num_query_groups, kv_channels=spec.kv_channels,
        gated_linear_unit=spec.gated_linear_unit)


def spec_of_dims(dims: ModelDims, **options) -> ModelSpec:
    """The spec of a model of these sizes with GPT-2's and BERT's options (LayerNorm, learned positions, GeLU MLP,
    biases) unless ``options`` (spec fields) say otherwise; the vocabulary as stored."""
    return ModelSpec(num_layers=dims.num_layers, hidden_size=dims.hidden_size,
                     num_attention_heads=dims.num_attention_heads, ffn_hidden_size=dims.ffn_hidden_size,
                     seq_length=dims.seq_length or dims.max_position_embeddings,
                     max_position_embeddings=dims.max_position_embeddings, padded_vocab_size=dims.padded_vocab_size,
                     layernorm_epsilon=dims.layernorm_epsilon, layernorm_zero_centered_gamma=dims.apply_layernorm_1p,
                     share_embeddings_and_output_weights=dims.tied_embeddings, **options)


def to_family_order(chunk: Dict[str, torch.Tensor], family: ModelFamily, megatron: bool) -> Dict[str, torch.Tensor]:
    """A chunk's parameters re-listed in our (or Megatron-Core's) module order; ``_extra_state`` entries dropped."""
    layer = family.megatron_layer if (megatron and family.megatron_layer) else family.layer
    last_stage = family.megatron_last_stage if (megatron and family.megatron_last_stage) else family.last_stage
    rank = {rel: i for i, rel in enumerate(layer)}

    def key(name: str):
        index, rel = family.split_layer_name(name)
        if index is None:
            group = 0 if name in family.first_stage else 2
            order = (family.first_stage + last_stage).index(name) if family.known(name) else 0
            return (group, 0, order)
        return (1, index, rank.get(rel, len(rank)))

    names = [n for n in chunk if not n.endswith("_extra_state")]
    return {n: chunk[n] for n in sorted(names, key=key)}
