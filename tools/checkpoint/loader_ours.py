"""``--loader ours``: one of our checkpoint folders (any TP/PP)."""

from megatron.core.checkpoint_formats import dims_from_args, read_our_checkpoint
from payload import Payload, payload_from_loaded, tokenizer_facts


def load(opts, family) -> Payload:
    loaded = read_our_checkpoint(opts.load_dir, load_optim=opts.reshard_optimizer, load_rng=opts.reshard_optimizer)
    vocab, eod, vocab_file, merge_file = tokenizer_facts(loaded.args_dict, opts.vocab_file, opts.merge_file)
    dims = dims_from_args(loaded.args_dict, vocab_size=opts.true_vocab_size or vocab)
    payload = payload_from_loaded(loaded, family, dims, "ours", opts)
    payload.vocab_file, payload.merge_file, payload.eod = vocab_file, merge_file, eod
    return payload
