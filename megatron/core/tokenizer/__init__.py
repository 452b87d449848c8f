"""Tokenizers: GPT-2 BPE, BERT WordPiece and Hugging Face tokenizer.json, Megatron-LM's NullTokenizer (see tokenizers.py)."""

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
