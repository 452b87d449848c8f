"""``--saver hf``: a Hugging Face folder ``transformers`` loads offline (weights only)."""

import os

from megatron.core.checkpoint_formats import CheckpointFormatError, save_hf_gpt2

# --model-type -> writer of a Hugging Face folder
HF_WRITERS = {"GPT": save_hf_gpt2}


def save(opts, payload) -> list:
    for flag, value in (("--target-tensor-parallel-size", opts.target_tensor_parallel_size),
                        ("--target-pipeline-parallel-size", opts.target_pipeline_parallel_size)):
        if value not in (None, 1):
            raise CheckpointFormatError(f"{flag} {value}: a Hugging Face model is not sharded (use 1 or leave it out)")
    if opts.reshard_optimizer:
        raise CheckpointFormatError("--reshard-optimizer: the hf saver writes model weights only")
    writer = HF_WRITERS.get(payload.family.name)
    if writer is None:
        raise CheckpointFormatError(f"--saver hf: no Hugging Face mapping for --model-type {payload.family.name}")
    args = payload.args
    if not (payload.vocab_file and payload.merge_file):
        payload.notes.append("no GPT-2 vocab/merges files found (pass --vocab-file/--merge-file): tokenizer files "
                             "not written")
    files = writer(opts.save_dir, payload.full, payload.dims, eod=payload.eod, vocab_file=payload.vocab_file,
                   merge_file=payload.merge_file,
                   dropout=(float(args.get("hidden_dropout", 0.1) or 0.0), float(args.get("attention_dropout", 0.1)
                                                                                or 0.0)),
                   init_std=float(args.get("init_method_std") or 0.02))
    return [os.path.join(opts.save_dir, f) for f in files]
