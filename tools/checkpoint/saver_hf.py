"""``--saver hf``: a Hugging Face folder ``transformers`` loads offline (weights only): for GPT,
``LlamaForCausalLM`` when the model has RMSNorm, rotary positions and SwiGLU (``Qwen2ForCausalLM`` when its only
biases are q, k, v's), else ``GPT2LMHeadModel``; ``BertForPreTraining`` (post-LN) or ``MegatronBertForPreTraining``
(pre-LN) for BERT (the masked-LM classes for a BERT without the binary head)."""

import dataclasses
import os
import shutil

from megatron.core.checkpoint_formats import CheckpointFormatError, save_hf_bert, save_hf_gpt2, spec_from_saved
from megatron.core.checkpoint_formats.hf_llama import llama_model_type, save_hf_llama


def _is_llama(spec) -> bool:
    """A Llama-family model (anything else with these options is refused by the Llama mapping, naming the flag)."""
    return spec.normalization == "RMSNorm" or spec.position_embedding_type == "rope" or spec.gated_linear_unit


def _save_llama(opts, payload, spec, init_std):
    dims = payload.dims
    if dims.vocab_size is None:
        raise CheckpointFormatError("the real vocabulary size is unknown (the checkpoint's arguments name no "
                                    "tokenizer); pass --true-vocab-size")
    spec = dataclasses.replace(spec, padded_vocab_size=dims.padded_vocab_size)
    tokenizer = payload.args.get("tokenizer_model")
    if not (payload.args.get("tokenizer_type") == "HuggingFaceTokenizer" and tokenizer):
        payload.notes.append("tokenizer files not written (the model was not trained with a HuggingFaceTokenizer "
                             "tokenizer.json): add the tokenizer's files to the folder")
    files = save_hf_llama(opts.save_dir, payload.full, spec, dims.vocab_size, eos=payload.eod, init_std=init_std)
    if payload.args.get("tokenizer_type") == "HuggingFaceTokenizer" and tokenizer:
        files = _copy_tokenizer(tokenizer, opts.save_dir)
    kind = llama_model_type(spec)
    payload.notes.append(f"written as {'Qwen2ForCausalLM' if kind == 'qwen2' else 'LlamaForCausalLM'}")
    return files


def _copy_tokenizer(tokenizer: str, out_dir: str) -> list:
    folder = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(out_dir, name))
    return sorted(os.listdir(out_dir))


def _save_gpt(opts, payload, dropout, init_std):
    spec = spec_from_saved(payload.args)
    if _is_llama(spec):
        return _save_llama(opts, payload, spec, init_std)
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
