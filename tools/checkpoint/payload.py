"""What a loader hands to a saver: the full model, its sizes, and (when read) the training state."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core.checkpoint_formats import (CheckpointFormatError, LoadedCheckpoint, ModelDims, ModelFamily,
                                              merge_tp_pp)
from megatron.core.checkpoint_formats.hf_bert import wordpiece_vocab_size
from megatron.core.checkpoint_formats.reshard import layout_of


@dataclass
class Payload:
    family: ModelFamily
    dims: ModelDims
    full: Dict[str, torch.Tensor]  # full (unsharded) model state dict, our names and order
    args: Dict[str, Any]  # saved arguments, plain types
    source: str  # "megatron", "ours" or "hf"
    source_layout: Tuple[int, int] = (1, 1)  # (tp, pp) of the source
    iteration: int = 0
    consumed_samples: int = 0
    model_ranks: Optional[dict] = None  # source per-rank chunks (for optimizer resharding)
    optimizer_ranks: Optional[dict] = None  # {(tp, pp): (named, meta)} in the source layout
    scheduler: Optional[dict] = None  # ours (iterations)
    rng: Optional[dict] = None  # {(tp, pp): ours} in the source layout
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    eod: Optional[int] = None
    notes: List[str] = field(default_factory=list)

    def num_params(self) -> int:
        return sum(t.numel() for t in self.full.values())


def tokenizer_facts(args: Dict[str, Any], vocab_file: Optional[str], merge_file: Optional[str]):
    """``(real vocabulary size, end-of-document id, vocab file, merge file)`` from flags or saved arguments: a
    GPT-2 ``vocab.json``, or a BERT WordPiece ``vocab.txt`` (with Megatron's [BOS]/[EOS] rows, as our tokenizer)."""
    vocab_file = vocab_file or args.get("vocab_file")
    merge_file = merge_file or args.get("merge_file")
    if vocab_file and os.path.isfile(vocab_file) and vocab_file.endswith(".json"):
        with open(vocab_file) as f:
            vocab = json.load(f)
        return len(vocab), vocab.get("<|endoftext|>"), vocab_file, merge_file
    if vocab_file and os.path.isfile(vocab_file) and (vocab_file.endswith(".txt") or
                                                      str(args.get("tokenizer_type")).startswith("BertWordPiece")):
        size, eod = wordpiece_vocab_size(vocab_file)
        if args.get("vocab_size"):  # the rows a converted Hugging Face model has (without Megatron's [BOS]/[EOS])
            size = int(args["vocab_size"])
        return size, (eod if eod < size else None), vocab_file, None
    size = args.get("vocab_size")
    if args.get("tokenizer_type") == "NullTokenizer":
        return None, None, None, None  # its end-of-document id adds a row: dims_from_args counts it
    return (int(size) if size else None), None, None, None


def check_family(loaded: LoadedCheckpoint, family: ModelFamily, where: str) -> None:
    """Refuse a checkpoint of another model type by its first foreign parameter name (e.g. a GPT read as BERT)."""
    for chunks in loaded.model_state_per_rank.values():
        for chunk in chunks:
            for name in chunk:
                if not name.endswith("_extra_state") and not family.known(name):
                    raise CheckpointFormatError(f"--model-type {family.name}: {where} holds {name}, which is not a "
                                                f"{family.name} parameter (is it another model type?)")


def payload_from_loaded(loaded: LoadedCheckpoint, family: ModelFamily, dims: ModelDims, source: str,
                        opts) -> Payload:
    check_family(loaded, family, opts.load_dir)
    full = merge_tp_pp(loaded.model_state_per_rank, family, tied=dims.tied_embeddings, dims=dims)
    family.check_shapes(full, dims, opts.load_dir)
    tp, pp, _ = layout_of(loaded.model_state_per_rank)
    return Payload(family=family, dims=dims, full=full, args=loaded.args_dict, source=source, source_layout=(tp, pp),
                   iteration=loaded.iteration, consumed_samples=loaded.consumed_samples,
                   model_ranks=loaded.model_state_per_rank, optimizer_ranks=loaded.extra.get("optimizer_by_name"),
                   scheduler=loaded.scheduler, rng=loaded.rng)
