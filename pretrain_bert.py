"""Pretrain a BERT: the model provider, the batch and loss functions, then ``pretrain()``.

    torchrun --nproc_per_node N pretrain_bert.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 512 --max-position-embeddings 512 --tokenizer-type BertWordPieceLowerCase \
        --vocab-file bert-large-uncased-vocab.txt --data-path PREFIX_text_sentence ...

The BERT flags are this entry point's own configuration section (``BertConfig`` in
``megatron/training/bert_section.py``, stored with the checkpoint's
arguments); every other flag is the trainer's. The iteration line reports ``lm loss``, ``sop loss`` and
``sop accuracy`` (the binary head's accuracy), evaluation the same (docs/bert.md).
"""

from __future__ import annotations

import sys
from typing import List, Optional

from megatron.core.models.bert import BertModel
from megatron.core.models.bert_loss import bert_loss_func, get_bert_batch, max_masked_positions
from megatron.training.bert_chunks import build_bert_chunks
from megatron.training.bert_section import BERT
from megatron.training.config import TrainingContext
from megatron.training.dry_run import print_dry_run, wants_dry_run
from megatron.training.setup import main_entry, print_rank_0, rank_0_first
from megatron.training.training import pretrain


def model_provider(ctx: TrainingContext) -> List[BertModel]:
    """This rank's BERT chunks (one per virtual pipeline stage), initialised layout-independently."""
    m, pstate, bert = ctx.config.model, ctx.pstate, ctx.config.extra["bert"]
    return build_bert_chunks(ctx, bert.apply_residual_connection_post_layernorm, lambda config, c: BertModel(
        config, pstate, pre_process=c.pre_process, post_process=c.post_process, num_layers=c.num_layers,
        layer_offset=c.layer_offset, num_tokentypes=2 if bert.bert_binary_head else 0,
        add_binary_head=bert.bert_binary_head, use_torch_compile=m.use_torch_compile))


def loss_func(loss_mask, is_random, output_tensor):
    """The MLM + sentence-order loss of one microbatch, and the binary head's accuracy on it."""
    loss, stats = bert_loss_func(loss_mask, is_random, output_tensor, binary_loss_name="sop loss")
    binary_logits = output_tensor[1]
    if binary_logits is not None:
        labels = is_random.reshape(-1)
        valid = labels >= 0
        hits = (binary_logits.detach().view(-1, 2).argmax(dim=-1) == labels) & valid
        stats["sop accuracy"] = hits.float().sum() / valid.float().sum().clamp(min=1.0)
    return loss, stats


def forward_step(ctx: TrainingContext, data_iterator, model):
    """Every pipeline stage reads the batch: each stage's attention needs the padding mask. The masked-LM head
    projects ``floor(--mask-prob x --seq-length)`` positions per sample; nothing here reads the device on the host,
    so ``--enable-cuda-graph`` can capture the step (the padding mask is then always passed)."""
    inner = getattr(model, "module", model)
    k = max_masked_positions(ctx.config.extra["bert"].mask_prob, ctx.config.model.seq_length)
    batch = get_bert_batch(data_iterator, ctx.pstate, k, capturable=ctx.config.training.enable_cuda_graph)
    post = inner.post_process
    output = model(batch["text"], batch["attention_mask"], tokentype_ids=batch["types"],
                   lm_labels=batch["labels"] if post else None, lm_loss_mask=batch["loss_mask"] if post else None,
                   max_masked_positions=k)
    return output, lambda out: loss_func(batch["loss_mask"], batch["is_random"], out)


def datasets_provider(ctx: TrainingContext, num_samples):
    """(train, valid, test) masked-LM datasets of ``--data-path`` (sentence-split data), or ``--mock-data``."""
    from megatron.core.datasets import BertDatasetConfig, MaskingConfig, WordPieceVocab, build_bert_datasets
    from megatron.core.datasets.builder import parse_data_path
    from megatron.core.datasets.checks import check_token_ids

    d, bert, seed = ctx.config.data, ctx.config.extra["bert"], ctx.config.training.seed
    config = BertDatasetConfig(
        seq_length=ctx.config.model.seq_length, seed=seed,
        vocab=WordPieceVocab.from_tokenizer(ctx.tokenizer, f"--vocab-file {d.vocab_file}"),
        short_seq_prob=bert.short_seq_prob, binary_head=bert.bert_binary_head,
        masking=MaskingConfig(mask_prob=bert.mask_prob, max_ngram=bert.masking_max_ngram,
                              whole_word=bert.whole_word_masking))
    if d.mock_data:
        from megatron.training.mock_bert_data import mock_bert_datasets

        print_rank_0(f"> mock BERT datasets of random sentences for {num_samples} (train, valid, test) samples")
        return mock_bert_datasets(num_samples, config)
    print_rank_0(f"> building BERT datasets for {num_samples} (train, valid, test) samples")

    def build(first: bool):
        try:
            if first:  # once, at start-up: token ids against the embedding's rows
                for prefix in parse_data_path(d.data_path)[0]:
                    check_token_ids(prefix, ctx.padded_vocab_size)
            return build_bert_datasets(d.data_path, d.split, config, num_samples, cache_dir=d.data_cache_path,
                                       is_rank_0=first, barrier=None if first else (lambda: None))
        except OSError as exc:
            raise ValueError(f"building the BERT datasets of --data-path {' '.join(d.data_path)} "
                             f"(--data-cache-path {d.data_cache_path}): {exc}") from None

    # rank 0 builds (and caches) the indices first; its errors reach every rank as the same single line
    return rank_0_first(build)


def main(argv: Optional[List[str]] = None, datasets=None):
    """Run pretraining; ``datasets(ctx, num_samples)`` may replace the ``--data-path`` datasets (tests)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if wants_dry_run(args):
        return print_dry_run(args, model="bert", extra_sections=[BERT])
    return pretrain(model_provider, forward_step, datasets or datasets_provider, argv=argv, extra_sections=[BERT])


if __name__ == "__main__":
    main_entry(main)
