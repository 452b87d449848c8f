"""Pretrain a BERT: the model provider, the batch and loss functions, then ``pretrain()``.

    torchrun --nproc_per_node N pretrain_bert.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 512 --max-position-embeddings 512 --tokenizer-type BertWordPieceLowerCase \
        --vocab-file bert-large-uncased-vocab.txt --data-path PREFIX_text_sentence ...

The BERT flags (``--bert-no-binary-head``, ``--apply-residual-connection-post-layernorm``, ``--mask-prob``,
``--short-seq-prob``) are read here; every other flag is the trainer's. The iteration line reports ``lm loss`` and
``sop loss`` (docs/bert.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from megatron.core.models.bert import BertModel, initialize_bert_parameters
from megatron.core.models.bert_loss import make_bert_forward_step
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.transformer.config import TransformerConfig
from megatron.training.arguments import pad_vocab_size, params_dtype
from megatron.training.training import main_entry, print_rank_0

BERT_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase")


def parse_bert_args(argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
    """Split off the BERT flags: ``(bert_args, the trainer's argv)``."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                        help="no pooler, binary (SOP) head or token-type embedding; the loss is the MLM loss")
    parser.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                        help="the original (post-LN) BERT order instead of pre-LN")
    parser.add_argument("--mask-prob", type=float, default=0.15, help="fraction of positions masked")
    parser.add_argument("--short-seq-prob", type=float, default=0.1,
                        help="probability of a sample with a shorter target length")
    bert_args, rest = parser.parse_known_args(argv)
    if not 0.0 < bert_args.mask_prob < 1.0:
        raise ValueError(f"--mask-prob must be in (0, 1), got {bert_args.mask_prob}")
    if not 0.0 <= bert_args.short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1], got {bert_args.short_seq_prob}")
    return bert_args, rest


def _tokenizer(args):
    from megatron.core.tokenizer import build_tokenizer

    if args.tokenizer_type not in BERT_TOKENIZERS:
        raise ValueError(f"BERT needs a WordPiece vocabulary with [CLS], [SEP] and [MASK]: --tokenizer-type must be "
                         f"one of {', '.join(BERT_TOKENIZERS)}, got {args.tokenizer_type}")
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file)


def bert_config(args, bert_args, padded_vocab_size: int) -> TransformerConfig:
    """The encoder's TransformerConfig from the trainer's flags plus the BERT ones."""
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings, padded_vocab_size=padded_vocab_size,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        layernorm_epsilon=args.layernorm_epsilon, layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        init_method_std=args.init_method_std, params_dtype=params_dtype(args),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        recompute_modules=tuple(args.recompute_modules), attention_backend=args.attention_backend,
        use_fused_kernels=not (args.no_bias_gelu_fusion or args.no_bias_dropout_fusion or args.no_persist_layer_norm),
        gradient_accumulation_fusion=not args.no_gradient_accumulation_fusion,
        fp8=args.fp8_format, fp8_margin=args.fp8_margin, fp8_recipe=args.fp8_recipe,
        fp8_amax_history_len=args.fp8_amax_history_len, fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        attention_mask_type="padding",
        apply_residual_connection_post_layernorm=bert_args.apply_residual_connection_post_layernorm,
    )


def model_provider(args, bert_args, pstate):
    """This rank's BERT chunks (one per virtual pipeline stage), initialised layout-independently."""
    if args.enable_cuda_graph:
        raise ValueError("--enable-cuda-graph captures the GPT step only; run BERT without it")
    tokenizer = _tokenizer(args)
    args.padded_vocab_size = pad_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, pstate.tp_size)
    print_rank_0(f"> vocabulary {tokenizer.vocab_size} padded to {args.padded_vocab_size}")
    config = bert_config(args, bert_args, args.padded_vocab_size)
    vpp = pstate.vpp_size or 1
    chunks = []
    for v in range(vpp):
        offset, count = layers_for_stage(
            args.num_layers, pstate.pp_size, pstate.pp_rank, vpp_size=pstate.vpp_size, vpp_rank=v,
            first_stage_layers=args.decoder_first_pipeline_num_layers,
            last_stage_layers=args.decoder_last_pipeline_num_layers)
        pre = pstate.is_pipeline_first_stage and v == 0
        post = pstate.is_pipeline_last_stage and v == vpp - 1
        model = BertModel(config, pstate, pre_process=pre, post_process=post, num_layers=count, layer_offset=offset,
                          num_tokentypes=2 if bert_args.bert_binary_head else 0,
                          add_binary_head=bert_args.bert_binary_head, use_torch_compile=args.use_torch_compile)
        initialize_bert_parameters(model, args.seed, config, pstate, layer_offset=offset)
        chunks.append(model)
    return chunks


def datasets_provider(args, bert_args, pstate, num_samples):
    """Train/valid/test BERT masked-LM datasets (Megatron-Core's sample order) from ``--data-path``."""
    import torch.distributed as dist

    try:
        from megatron.core.datasets.bert_dataset import build_bert_datasets
    except ImportError as exc:
        raise ValueError(f"BERT training needs the masked-LM dataset (megatron/core/datasets/bert_dataset.py): "
                         f"{exc}") from exc
    print_rank_0(f"> building BERT datasets for {num_samples} (train, valid, test) samples")
    return build_bert_datasets(
        args.data_path, args.split, args.seq_length, args.seed, num_samples, tokenizer=_tokenizer(args),
        masking_probability=bert_args.mask_prob, short_sequence_probability=bert_args.short_seq_prob,
        classification_head=bert_args.bert_binary_head, cache_dir=args.data_cache_path,
        is_rank_0=(pstate.rank == 0), barrier=(dist.barrier if dist.is_initialized() else None))


class _Deferred:
    """Binds the parsed flags lazily: pretrain() parses them, the model provider sees them first."""

    def __init__(self):
        self.fn = None

    def __call__(self, *a):
        return self.fn(*a)


def main(argv: Optional[List[str]] = None, datasets=None):
    """Run pretraining; ``datasets(args, bert_args, pstate, num_samples)`` replaces the ``--data-path`` datasets
    (tests train on an in-memory dataset through the same loop)."""
    from megatron.training.training import pretrain

    bert_args, rest = parse_bert_args(list(sys.argv[1:] if argv is None else argv))
    step = _Deferred()
    build_datasets = datasets or datasets_provider

    def provider(args, pstate):
        step.fn = make_bert_forward_step(pstate, binary_loss_name="sop loss")
        return model_provider(args, bert_args, pstate)

    return pretrain(provider, step, lambda args, pstate, n: build_datasets(args, bert_args, pstate, n), argv=rest)


if __name__ == "__main__":
    main_entry(main)
