"""Tokenizers: GPT-2 BPE, BERT WordPiece, Hugging Face tokenizer.json and Megatron-LM's NullTokenizer (see
tokenizers.py)."""

from megatron.core.tokenizer.tokenizers import (
    TOKENIZER_TYPES,
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
)

__all__ = [
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "build_tokenizer",
]
