"""Tokenizers: GPT-2 BPE, BERT WordPiece, Hugging Face tokenizer.json and Megatron-LM's NullTokenizer (see
tokenizers.py), SentencePiece and Llama 2's SentencePiece (sentencepiece_tokenizers.py, imported when used)."""

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
