"""``--loader megatron``: a Megatron-LM checkpoint folder: legacy torch format (any TP/PP, model and training
state; pre-Core files for their weights) read through the allowlist, or torch_dist (model and training state)."""

from megatron.core.checkpoint_formats import CheckpointFormatError, dims_from_args, read_megatron_checkpoint
from payload import Payload, payload_from_loaded, tokenizer_facts


def load(opts, family) -> Payload:
    loaded = read_megatron_checkpoint(opts.load_dir, family, load_optim=opts.reshard_optimizer,
                                      load_rng=opts.reshard_optimizer,
                                      num_attention_heads=getattr(opts, "num_attention_heads", None))
    if loaded.extra.get("format") == "torch_dist":
        if not loaded.extra.get("args_from_checkpoint"):
            raise CheckpointFormatError(f"{loaded.extra['iter_dir']}/common.pt holds no 'args': the model's sizes "
                                        "are unknown")
    vocab, eod, vocab_file, merge_file = tokenizer_facts(loaded.args_dict, opts.vocab_file, opts.merge_file)
    dims = dims_from_args(loaded.args_dict, vocab_size=opts.true_vocab_size or vocab)
    payload = payload_from_loaded(loaded, family, dims, "megatron", opts)
    payload.vocab_file, payload.merge_file, payload.eod = vocab_file, merge_file, eod
    return payload
