"""``--saver hf``: a Hugging Face folder ``transformers`` loads offline (weights only): ``GPT2LMHeadModel`` for
GPT; ``BertForPreTraining`` (post-LN) or ``MegatronBertForPreTraining`` (pre-LN) for BERT (the masked-LM classes
for a BERT without the binary head)."""

import os

from megatron.core.checkpoint_formats import CheckpointFormatError, save_hf_bert, save_hf_gpt2


def _save_gpt(opts, payload, dropout, init_std):
    if not (payload.vocab_file and payload.merge_file):
        payload.notes.append("no GPT-2 vocab/merges files found (pass --vocab-file/--merge-file): tokenizer files "
                             "not written")
    return save_hf_gpt2(opts.save_dir, payload.full, payload.dims, eod=payload.eod, vocab_file=payload.vocab_file,
                        merge_file=payload.merge_file, dropout=dropout, init_std=init_std)


def _save_bert(opts, payload, dropout, init_std):
    args = payload.args
    post_ln = bool(args.get("apply_residual_connection_post_layernorm", False))
    if not payload.vocab_file:
        payload.notes.append("no WordPiece vocab.txt found (pass --vocab-file): tokenizer files not written")
    lower = args.get("tokenizer_type") != "BertWordPieceCase"
    payload.notes.append(f"{'post' if post_ln else 'pre'}-LN BERT written as "
                         f"{'BertFor' if post_ln else 'MegatronBertFor'}"
                         f"{'PreTraining' if 'binary_head.weight' in payload.full else 'MaskedLM'}")
    return save_hf_bert(opts.save_dir, payload.full, payload.dims, post_ln, vocab_file=payload.vocab_file,
                        lower_case=lower, dropout=dropout, init_std=init_std)


# --model-type -> writer of a Hugging Face folder
HF_WRITERS = {"GPT": _save_gpt, "BERT": _save_bert}


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
    dropout = (float(args.get("hidden_dropout", 0.1) or 0.0), float(args.get("attention_dropout", 0.1) or 0.0))
    files = writer(opts, payload, dropout, float(args.get("init_method_std") or 0.02))
    return [os.path.join(opts.save_dir, f) for f in files]
