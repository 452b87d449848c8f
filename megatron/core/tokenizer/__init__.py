"""Tokenizers: GPT-2 BPE, BERT WordPiece and Hugging Face tokenizer.json (see tokenizers.py)."""

from megatron.core.tokenizer.tokenizers import (
    TOKENIZER_TYPES,
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    build_tokenizer,
)

__all__ = [
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "build_tokenizer",
]
