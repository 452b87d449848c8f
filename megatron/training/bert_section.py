"""pretrain_bert.py's own configuration section: the BERT flags (``BertConfig``), read by the entry point and by
the planner (``tools/plan.py --model bert``) through the trainer's parser."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.datasets.bert_dataset import MIN_SEQ_LENGTH
from megatron.training.config import ExtraSection
from megatron.training.flag_table import ConfigError

BERT_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase")


@dataclass(frozen=True)
class BertConfig:
    """pretrain_bert's own flags (Megatron-LM's names; the last two are settings Megatron fixes in code)."""
    bert_binary_head: bool
    mask_prob: float
    short_seq_prob: float
    apply_residual_connection_post_layernorm: bool
    whole_word_masking: bool
    masking_max_ngram: int


def add_bert_arguments(parser) -> None:
    g = parser.add_argument_group("BERT")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="no pooler, binary (sentence-order) head or token-type embedding; the loss is the MLM loss")
    g.add_argument("--bert-binary-head", action="store_true", dest="bert_binary_head", default=True,
                   help="the sentence-order head (the default)")
    g.add_argument("--mask-prob", type=float, default=0.15, help="fraction of positions masked (default 0.15)")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="probability of a sample with a shorter target length (default 0.1)")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="the original (post-LN) BERT order instead of pre-LN")
    g.add_argument("--no-whole-word-masking", action="store_false", dest="whole_word_masking",
                   help="mask WordPiece tokens independently instead of whole words")
    g.add_argument("--masking-max-ngram", type=int, default=3,
                   help="longest n-gram of words masked together (default 3, Megatron's value)")


def validate_bert(ns) -> None:
    if ns.tokenizer_type not in BERT_TOKENIZERS:
        raise ConfigError(f"BERT needs a WordPiece vocabulary with [CLS], [SEP] and [MASK]: --tokenizer-type must be "
                          f"one of {', '.join(BERT_TOKENIZERS)}, got {ns.tokenizer_type}")
    if not 0.0 < ns.mask_prob < 1.0:
        raise ConfigError(f"--mask-prob must be in (0, 1), got {ns.mask_prob}")
    if not 0.0 <= ns.short_seq_prob <= 1.0:
        raise ConfigError(f"--short-seq-prob must be in [0, 1], got {ns.short_seq_prob}")
    if ns.masking_max_ngram < 1:
        raise ConfigError(f"--masking-max-ngram must be >= 1, got {ns.masking_max_ngram}")
    if ns.seq_length < MIN_SEQ_LENGTH:
        raise ConfigError(f"--seq-length {ns.seq_length} is too short for a BERT sample [CLS] A [SEP] B [SEP]: "
                          f"at least {MIN_SEQ_LENGTH} tokens are needed")


BERT = ExtraSection("bert", BertConfig, add_bert_arguments, validate_bert)
