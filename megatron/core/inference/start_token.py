"""Where a token sequence starts, for every tokenizer the inference tools read.

A Llama-family tokenizer (``HuggingFaceTokenizer`` on a Llama-style ``tokenizer.json``, ``Llama2Tokenizer``) has a
beginning-of-text id, ``bos``, and its ``tokenize`` already puts it first, as Hugging Face's tokenizers do. GPT-2's
has none: a sequence that must not start from nothing starts from the end-of-document id, as in Megatron-LM.
"""

from __future__ import annotations

from typing import List


def start_token(tokenizer) -> int:
    """The tokenizer's beginning-of-text id, or its end-of-document id when it has none."""
    bos = getattr(tokenizer, "bos", None)
    return tokenizer.eod if bos is None else int(bos)


def with_start_token(tokenizer, ids: List[int]) -> List[int]:
    """``ids`` beginning with :func:`start_token` (as they are when the tokenizer put it there already)."""
    first = start_token(tokenizer)
    return list(ids) if list(ids[:1]) == [first] else [first] + list(ids)


def continuation_ids(tokenizer, text: str) -> List[int]:
    """The ids of ``text`` following other text: without the beginning-of-text id the tokenizer may put first."""
    ids = tokenizer.tokenize(text)
    bos = getattr(tokenizer, "bos", None)
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids
