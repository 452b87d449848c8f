"""``--loader hf``: a Hugging Face model folder (``model.safetensors`` or ``pytorch_model.bin``, read safely)."""

import os

from megatron.core.checkpoint_formats import CheckpointFormatError, load_hf_gpt2
from payload import Payload

# --model-type -> reader of a Hugging Face folder: (full, dims, config, notes)
HF_READERS = {"GPT": load_hf_gpt2}


def load(opts, family) -> Payload:
    if opts.reshard_optimizer:
        raise CheckpointFormatError("--reshard-optimizer: a Hugging Face folder holds no optimizer state")
    reader = HF_READERS.get(family.name)
    if reader is None:
        raise CheckpointFormatError(f"--loader hf: no Hugging Face mapping for --model-type {family.name}")
    full, dims, config, notes = reader(opts.load_dir, opts.make_vocab_size_divisible_by or 128)
    family.check_shapes(full, dims, opts.load_dir)
    vocab_file = opts.vocab_file or _existing(opts.load_dir, "vocab.json")
    merge_file = opts.merge_file or _existing(opts.load_dir, "merges.txt")
    args = {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size,
            "num_attention_heads": dims.num_attention_heads, "hidden_dropout": config.get("resid_pdrop", 0.1),
            "attention_dropout": config.get("attn_pdrop", 0.1),
            "init_method_std": config.get("initializer_range", 0.02),
            "tokenizer_type": "GPT2BPETokenizer" if vocab_file else None, "vocab_file": vocab_file,
            "merge_file": merge_file}
    return Payload(family=family, dims=dims, full=full, args=args, source="hf", vocab_file=vocab_file,
                   merge_file=merge_file, eod=config.get("eos_token_id"), notes=list(notes))


def _existing(folder: str, name: str):
    path = os.path.join(folder, name)
    return os.path.abspath(path) if os.path.isfile(path) else None
