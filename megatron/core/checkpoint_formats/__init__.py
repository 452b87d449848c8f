"""Checkpoint formats: Megatron-LM's legacy torch checkpoints (read and write), ours (any TP/PP), Hugging Face GPT-2
and BERT, and resharding between tensor/pipeline-parallel layouts, for GPT and BERT. Importable without the trainer;
never imports Megatron.

Main entry points (see docs/checkpoints.md):

- :func:`read_megatron_checkpoint` / :func:`read_our_checkpoint` -> :class:`LoadedCheckpoint`
  ``(model_state_per_rank, optimizer, scheduler, rng, iteration, consumed_samples, args_dict, extra)``
- :func:`reshard` (model state dicts), :func:`reshard_named` (optimizer state by parameter name)
- :func:`write_megatron_checkpoint` / :func:`write_our_checkpoint`
- :func:`save_hf_gpt2` / :func:`load_hf_gpt2`, :func:`save_hf_bert` / :func:`load_hf_bert`
- :func:`state_for_rank`: one rank's model, optimizer and RNG state at the running layout (load-time resharding)
"""

from megatron.core.checkpoint_formats.common import SPEC_KEY, LoadedCheckpoint, dims_from_args, spec_from_saved
from megatron.core.checkpoint_formats.hf_bert import from_hf_bert, load_hf_bert, save_hf_bert, to_hf_bert
from megatron.core.checkpoint_formats.hf_gpt2 import (build_hf_gpt2, from_hf_gpt2, load_hf_gpt2, save_hf_gpt2,
                                                      to_hf_gpt2)
from megatron.core.checkpoint_formats.layout import (BERT, GPT, ModelDims, ModelFamily, get_family, pad_vocab_size,
                                                     register_family)
from megatron.core.checkpoint_formats.load_time import state_for_rank
from megatron.core.checkpoint_formats.megatron_lm import read_megatron_checkpoint, write_megatron_checkpoint
from megatron.core.checkpoint_formats.optimizer_state import reshard_named
from megatron.core.checkpoint_formats.ours import read_our_checkpoint, write_our_checkpoint
from megatron.core.checkpoint_formats.reshard import merge_tp_pp, reshard, split_tp_pp
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError, load_megatron_file

__all__ = [
    "BERT", "SPEC_KEY", "spec_from_saved", "CheckpointFormatError", "GPT", "build_hf_gpt2", "from_hf_bert", "load_hf_bert", "save_hf_bert",
    "to_hf_bert", "LoadedCheckpoint", "ModelDims", "ModelFamily", "dims_from_args",
    "from_hf_gpt2", "get_family", "load_hf_gpt2", "load_megatron_file", "merge_tp_pp", "pad_vocab_size",
    "read_megatron_checkpoint", "read_our_checkpoint", "register_family", "reshard", "reshard_named",
    "save_hf_gpt2", "split_tp_pp", "state_for_rank", "to_hf_gpt2", "write_megatron_checkpoint", "write_our_checkpoint",
]
