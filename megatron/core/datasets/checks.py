"""Checks run once when a ``.bin``/``.idx`` dataset is opened for training.

``check_token_ids`` finds the largest (and smallest) token id of the ``.bin`` with a vectorised max over
chunks of the memory map, and raises one line naming the file and the id when it does not fit the model's
vocabulary: without it, a bad id surfaces deep in the embedding as ``IndexError: index out of range``.
``sentence_level_warning`` names data split into sentences (``--split-sentences``, ``*_sentence`` files)
given to a consumer that reads one sequence per document (GPT).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDataset, bin_path, idx_path

CHUNK_BYTES = 32 << 20  # one chunk of the memory map at a time: bounded memory, few Python steps


@dataclass(frozen=True)
class TokenRange:
    """The smallest and largest id of a ``.bin`` and the first sequence holding the largest."""

    min_id: int
    max_id: int
    max_sequence: int
    num_tokens: int


def _open(dataset: Union[str, IndexedDataset]) -> IndexedDataset:
    return dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(dataset)


def token_range(dataset: Union[str, IndexedDataset], chunk_bytes: int = CHUNK_BYTES) -> Optional[TokenRange]:
    """Min and max token id over every sequence the ``.idx`` describes; None for an empty dataset."""
    ds = _open(dataset)
    if len(ds) == 0 or int(ds.sequence_lengths.sum(dtype=np.int64)) == 0:
        return None
    itemsize = ds.dtype.itemsize
    start = int(ds.sequence_pointers.min())
    end = int(ds.sequence_pointers[-1]) + int(ds.sequence_lengths[-1]) * itemsize
    expected = int(ds.sequence_lengths.sum(dtype=np.int64)) * itemsize
    if end - start != expected or np.any(np.diff(ds.sequence_pointers) < 0):  # not back to back, in order
        return _token_range_per_sequence(ds)  # (as writers lay them out): [start, end) may not be the tokens
    raw = np.memmap(bin_path(ds.path_prefix), mode="r", dtype=np.uint8)
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    lo, hi, hi_at = None, None, -1
    for off in range(start, end, step):
        n = min(step, end - off) // itemsize
        chunk = np.frombuffer(raw, dtype=ds.dtype, count=n, offset=off)
        cmax, cmin = chunk.max(), chunk.min()
        if hi is None or cmax > hi:
            hi, hi_at = cmax, off + int(np.argmax(chunk)) * itemsize
        if lo is None or cmin < lo:
            lo = cmin
    # The sequence holding byte hi_at: the last pointer at or before it.
    seq = int(np.searchsorted(ds.sequence_pointers, hi_at, side="right")) - 1
    return TokenRange(int(lo), int(hi), seq, expected // itemsize)


def _token_range_per_sequence(ds: IndexedDataset) -> TokenRange:
    """The slow path, one sequence at a time, for a ``.bin`` whose sequences are not stored in order."""
    lo, hi, hi_seq = None, None, -1
    for i in range(len(ds)):
        seq = ds[i]
        if seq.size == 0:
            continue
        smax, smin = seq.max(), seq.min()
        if hi is None or smax > hi:
            hi, hi_seq = smax, i
        if lo is None or smin < lo:
            lo = smin
    return TokenRange(int(lo), int(hi), hi_seq, int(ds.sequence_lengths.sum(dtype=np.int64)))


def check_token_ids(dataset: Union[str, IndexedDataset], vocab_size: int,
                    chunk_bytes: int = CHUNK_BYTES) -> Optional[TokenRange]:
    """Raise ``ValueError`` when a token id of the ``.bin`` is negative or not below ``vocab_size``.

    ``vocab_size`` is the number of rows of the model's embedding (the padded vocabulary). Datasets whose dtype
    cannot hold an id that large (e.g. uint16 with a vocabulary over 65,535) are not read at all.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocabulary size must be positive, got {vocab_size}")
    ds = _open(dataset)
    if ds.dtype.kind == "u" and np.iinfo(ds.dtype).max < vocab_size:
        return None  # every value of the dtype is a valid id
    found = token_range(ds, chunk_bytes)
    if found is None:
        return None
    path = bin_path(ds.path_prefix)
    if found.max_id >= vocab_size:
        raise ValueError(f"{path}: token id {found.max_id} (largest in the file, first in sequence "
                         f"{found.max_sequence}) is not below the model's vocabulary size {vocab_size}; "
                         "was the data made with another tokenizer?")
    if found.min_id < 0:
        raise ValueError(f"{path}: negative token id {found.min_id}; the file is not token data or is damaged")
    return found


def sentence_level_warning(dataset: Union[str, IndexedDataset], consumer: str = "GPT") -> Optional[str]:
    """A one-line warning when the ``.idx`` has more sequences than documents (sentence-level data)."""
    ds = _open(dataset)
    sequences, documents = len(ds), len(ds.document_indices) - 1
    if sequences == documents:
        return None
    named = " (its name says _sentence)" if os.path.basename(ds.path_prefix).endswith("_sentence") else ""
    return (f"{idx_path(ds.path_prefix)}{named} is sentence-level data: {sequences} sequences in {documents} "
            f"documents, but {consumer} training reads one sequence per document; preprocess the corpus "
            "without --split-sentences for it")


def check_gpt_dataset(prefix: str, vocab_size: int) -> Optional[TokenRange]:
    """Both checks for a GPT data prefix: errors raise ``ValueError``, the sentence warning is issued."""
    ds = IndexedDataset(prefix)
    message = sentence_level_warning(ds, "GPT")
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=2)
    return check_token_ids(ds, vocab_size)
