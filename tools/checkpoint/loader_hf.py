"""``--loader hf``: a Hugging Face model folder (``model.safetensors`` or ``pytorch_model.bin``, read safely):
for ``--model-type GPT`` GPT-2, or ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` (chosen
by ``config.json``'s ``model_type``); ``BertForPreTraining`` (post-LN) or ``MegatronBertForPreTraining``
(pre-LN), or their masked-LM variants, for ``--model-type BERT``."""

import json
import os

from megatron.core.checkpoint_formats import CheckpointFormatError, load_hf_bert, load_hf_gpt2
from megatron.core.checkpoint_formats.hf_llama import ARCHITECTURES, hf_model_type, load_hf_llama
from megatron.core.model_spec import spec_to_args
from payload import Payload

# --model-type -> reader of a Hugging Face folder: (full, dims, config, notes)
HF_READERS = {"GPT": load_hf_gpt2, "BERT": load_hf_bert}


def load(opts, family) -> Payload:
    if opts.reshard_optimizer:
        raise CheckpointFormatError("--reshard-optimizer: a Hugging Face folder holds no optimizer state")
    if family.name == "GPT" and hf_model_type(opts.load_dir) in ARCHITECTURES:
        return _llama_payload(opts, family)
    reader = HF_READERS.get(family.name)
    if reader is None:
        raise CheckpointFormatError(f"--loader hf: no Hugging Face mapping for --model-type {family.name}")
    full, dims, config, notes = reader(opts.load_dir, opts.make_vocab_size_divisible_by or 128)
    family.check_shapes(full, dims, opts.load_dir)
    if family.name == "BERT":
        return _bert_payload(opts, family, full, dims, config, notes)
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


def _llama_payload(opts, family) -> Payload:
    """A Llama-family folder: the model description as Megatron-LM's flags, and its ``tokenizer.json`` (when the
    folder has one) as ``--tokenizer-type HuggingFaceTokenizer``."""
    full, dims, config, spec = load_hf_llama(opts.load_dir, opts.make_vocab_size_divisible_by or 128)
    family.check_shapes(full, dims, opts.load_dir)
    tokenizer = _existing(opts.load_dir, "tokenizer.json")
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    args = dict(spec_to_args(spec), vocab_size=dims.vocab_size,
                make_vocab_size_divisible_by=dims.make_vocab_size_divisible_by,
                hidden_dropout=0.0, attention_dropout=float(config.get("attention_dropout", 0.0)),
                init_method_std=config.get("initializer_range", 0.02),
                tokenizer_type="HuggingFaceTokenizer" if tokenizer else None,
                tokenizer_model=os.path.dirname(tokenizer) if tokenizer else None)
    notes = [f"{ARCHITECTURES[config['model_type']]}: train or generate with "
             f"{' '.join(_llama_flags(args))}"]
    return Payload(family=family, dims=dims, full=full, args=args, source="hf", eod=eos, notes=notes)


def _llama_flags(args) -> list:
    """The model's Megatron-LM flags beyond the sizes (for the note printed after the conversion)."""
    flags = [f"--position-embedding-type rope --rotary-base {args['rotary_base']}", "--normalization RMSNorm",
             f"--norm-epsilon {args['norm_epsilon']:g}", "--swiglu"]
    if args["group_query_attention"]:
        flags.append(f"--group-query-attention --num-query-groups {args['num_query_groups']}")
    if args["use_rope_scaling"]:
        flags.append(f"--use-rope-scaling --rope-scaling-factor {args['rope_scaling_factor']:g}")
    if not args["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    if args["add_qkv_bias"]:
        flags.append("--add-qkv-bias")
    if args["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def _bert_payload(opts, family, full, dims, config, notes) -> Payload:
    """BERT's saved arguments: the LayerNorm order, the binary head, the WordPiece vocabulary and its case."""
    vocab_file = opts.vocab_file or _existing(opts.load_dir, "vocab.txt")
    lower = True
    tok_cfg = os.path.join(opts.load_dir, "tokenizer_config.json")
    if os.path.isfile(tok_cfg):
        with open(tok_cfg) as f:
            lower = bool(json.load(f).get("do_lower_case", True))
    args = {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size,
            "num_attention_heads": dims.num_attention_heads,
            "hidden_dropout": config.get("hidden_dropout_prob", 0.1),
            "attention_dropout": config.get("attention_probs_dropout_prob", 0.1),
            "init_method_std": config.get("initializer_range", 0.02),
            "apply_residual_connection_post_layernorm": config.get("model_type") == "bert",
            "bert_binary_head": "binary_head.weight" in full,
            "tokenizer_type": ("BertWordPieceLowerCase" if lower else "BertWordPieceCase") if vocab_file else None,
            "vocab_file": vocab_file}
    post_ln, binary = args["apply_residual_connection_post_layernorm"], args["bert_binary_head"]
    flags = (["--apply-residual-connection-post-layernorm"] if post_ln else []) + \
        ([] if binary else ["--bert-no-binary-head"])
    notes = list(notes) + [f"{'post' if post_ln else 'pre'}-LN BERT{'' if binary else ' without the binary head'}: "
                           f"run pretrain_bert.py on it with {' '.join(flags) or 'the default (pre-LN) order'}"]
    return Payload(family=family, dims=dims, full=full, args=args, source="hf", vocab_file=vocab_file, notes=notes)


def _existing(folder: str, name: str):
    path = os.path.join(folder, name)
    return os.path.abspath(path) if os.path.isfile(path) else None
