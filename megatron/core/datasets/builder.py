"""``build_gpt_datasets`` / ``build_bert_datasets``: train/valid/test datasets from ``--data-path``, ``--split``
and sample counts.

Follows Megatron-Core's ``BlendedMegatronDatasetBuilder`` for a blend shared by all splits:

* ``--split "949,50,1"`` is normalised to fractions; split ``i`` covers documents
  ``[round(lo_i * docs), round(hi_i * docs))`` of every dataset, ``lo``/``hi`` the running sums;
* one prefix without a weight: each split is one dataset (``GPTDataset`` or ``BERTMaskedDataset``) asked
  for the split's sample count;
* weighted prefixes: dataset ``j`` is asked for ``ceil(ceil(n_i * w_j) * 1.005)`` samples of split ``i``
  (the 0.5% surplus) and the split is a ``BlendedDataset`` of ``sum_j ceil(n_i * w_j)`` samples;
* several prefixes without weights: every dataset is one epoch; the split blends them by their sizes,
  capped at the requested count.

A split whose fraction or requested sample count is 0 is ``None``.

Distributed use: call on every rank with ``is_rank_0`` true on exactly one rank and ``barrier`` a
callable that synchronises all ranks (e.g. ``torch.distributed.barrier``). Rank 0 builds the indices and
writes them under ``cache_dir``; after the barrier the other ranks memory-map them.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from megatron.core.datasets.bert_dataset import BERTMaskedDataset, BertDatasetConfig, check_sentence_data
from megatron.core.datasets.blended_dataset import BlendedDataset, normalize
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, dataset_exists

SPLIT_NAMES = ("train", "valid", "test")
MID_LEVEL_SURPLUS = 0.005


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """``[p1, p2, ...]`` or ``[w1, p1, w2, p2, ...]`` -> (prefixes, weights or None), as Megatron reads it."""
    items = [str(x) for x in data_path]
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) % 2 == 1:
        return [p.strip() for p in items], None
    weights: List[Optional[float]] = []
    for w in items[0::2]:
        try:
            weights.append(float(w))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return [p.strip() for p in items], None
    if any(w is None for w in weights):
        raise ValueError(f"--data-path {items}: mixes weights and prefixes; give 'w1 p1 w2 p2 ...' or 'p1 p2 ...'")
    if any(w <= 0 for w in weights):
        raise ValueError(f"--data-path weights must be positive, got {weights}")
    return [p.strip() for p in items[1::2]], weights  # type: ignore[return-value]


def parse_split(split: str) -> List[float]:
    """``"949,50,1"`` -> normalised fractions for train, valid, test (missing parts are 0)."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not parts or len(parts) > 3:
        raise ValueError(f"--split {split!r}: expected up to three comma-separated numbers like 949,50,1")
    parts += [0.0] * (3 - len(parts))
    if sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: the parts sum to 0")
    return normalize(parts)


def split_bounds(fractions: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Running-sum book-ends (lo, hi) of each split, None for an empty split."""
    ends = functools.reduce(lambda acc, f: acc + [acc[-1] + f], fractions, [0])
    return [(lo, hi) if hi > lo else None for lo, hi in zip(ends[:-1], ends[1:])]


def split_range(num_docs: int, bounds: Optional[Tuple[float, float]]) -> Tuple[int, int]:
    """Half-open document range ``[beg, end)`` of one split (``(0, 0)`` for a split without a share)."""
    if bounds is None:
        return 0, 0
    return int(round(bounds[0] * float(num_docs))), int(round(bounds[1] * float(num_docs)))


def split_documents(num_docs: int, bounds: Optional[Tuple[float, float]]) -> Optional[np.ndarray]:
    """Document ids (int32) of one split."""
    if bounds is None:
        return None
    beg, end = split_range(num_docs, bounds)
    return np.arange(beg, end, dtype=np.int32)


def check_splits_not_empty(indexed: Sequence[IndexedDataset], bounds, wanted: Sequence[bool], split: str) -> None:
    """Raise ``ValueError`` naming the document range and ``--split`` when a split asked for samples is empty."""
    for ds in indexed:
        num_docs = len(ds.document_indices) - 1
        for i in range(3):
            if not wanted[i]:
                continue
            beg, end = split_range(num_docs, bounds[i])
            if end == beg:
                raise ValueError(
                    f"the {SPLIT_NAMES[i]} split of {ds.path_prefix} is empty (documents [{beg}, {end}) of "
                    f"{num_docs} with --split {split}): it has 0 tokens; give it a larger share in --split "
                    f"or ask it for 0 samples")


def _per_dataset_sizes(weights: Sequence[float], sizes: Sequence[int], surplus: float = 0.0) -> List[List[int]]:
    return [[int(math.ceil(math.ceil(n * w) * (1 + surplus))) for n in sizes] for w in weights]


def build_gpt_datasets(data_path: Sequence[str], split: str, seq_length: int, seed: int,
                       train_valid_test_num_samples: Sequence[int], cache_dir: Optional[str] = None,
                       is_rank_0: bool = True, barrier: Optional[Callable[[], None]] = None):
    """(train, valid, test) datasets whose items are ``{"text": int64[seq_length + 1]}`` (see module doc)."""
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")

    def make(ds: IndexedDataset, documents: np.ndarray, num_samples: Optional[int], name: str, build: bool):
        return GPTDataset(ds, documents, num_samples, seq_length, seed, name, cache_dir, build)

    return build_split_datasets(make, data_path, split, train_valid_test_num_samples, cache_dir, is_rank_0,
                                barrier)


def build_bert_datasets(data_path: Sequence[str], split: str, config: BertDatasetConfig,
                        train_valid_test_num_samples: Sequence[int], cache_dir: Optional[str] = None,
                        is_rank_0: bool = True, barrier: Optional[Callable[[], None]] = None):
    """(train, valid, test) masked-LM datasets of sentence-split data (``BERTMaskedDataset`` items)."""

    def make(ds: IndexedDataset, documents: np.ndarray, num_samples: Optional[int], name: str, build: bool):
        return BERTMaskedDataset(ds, documents, num_samples, config, name, cache_dir, build)

    return build_split_datasets(make, data_path, split, train_valid_test_num_samples, cache_dir, is_rank_0,
                                barrier, check=_check_bert_data)


def _check_bert_data(indexed: Sequence[IndexedDataset]) -> None:
    for ds in indexed:
        check_sentence_data(ds)


def build_split_datasets(make: Callable, data_path: Sequence[str], split: str,
                         train_valid_test_num_samples: Sequence[int], cache_dir: Optional[str] = None,
                         is_rank_0: bool = True, barrier: Optional[Callable[[], None]] = None,
                         check: Optional[Callable[[Sequence[IndexedDataset]], None]] = None):
    """(train, valid, test) of any dataset class: ``make(indexed, documents, num_samples, split_name, build)``
    returns one split's dataset of one prefix; blends are built around them as the module doc says.
    ``check(indexed_datasets)`` validates the data on every rank before any barrier."""
    if len(train_valid_test_num_samples) != 3:
        raise ValueError(f"train_valid_test_num_samples needs 3 counts, got {train_valid_test_num_samples}")
    sizes = [int(n) for n in train_valid_test_num_samples]
    if any(n < 0 for n in sizes):
        raise ValueError(f"sample counts must be >= 0, got {sizes}")
    prefixes, weights = parse_data_path(data_path)
    bounds = split_bounds(parse_split(split))
    for p in prefixes:  # checked on every rank before any barrier, so no rank waits for a failed one
        if not dataset_exists(p):
            raise ValueError(f"--data-path {p}: expected {p}.bin and {p}.idx")
    wanted = [bounds[i] is not None and sizes[i] > 0 for i in range(3)]
    indexed = [IndexedDataset(p) for p in prefixes]
    check_splits_not_empty(indexed, bounds, wanted, split)
    if check is not None:
        check(indexed)

    def build_all(build: bool):
        return _build(make, indexed, weights, bounds, sizes, wanted, cache_dir, build)

    if barrier is None:
        return build_all(True)
    if is_rank_0:
        result = build_all(True)
        barrier()
        return result
    barrier()
    return build_all(False)


def _build(make, indexed, weights, bounds, sizes, wanted, cache_dir, build):
    def one(ds: IndexedDataset, i: int, num_samples: Optional[int]):
        docs = split_documents(len(ds.document_indices) - 1, bounds[i])
        return make(ds, docs, num_samples, SPLIT_NAMES[i], build)

    if len(indexed) == 1 and weights is None:
        return tuple(one(indexed[0], i, sizes[i]) if wanted[i] else None for i in range(3))

    out: List[Optional[object]] = [None, None, None]
    if weights is not None:
        w = normalize(weights)
        target = _per_dataset_sizes(w, sizes)
        buffer = _per_dataset_sizes(w, sizes, MID_LEVEL_SURPLUS)
        for i in range(3):
            if wanted[i]:
                mids = [one(ds, i, buffer[j][i]) for j, ds in enumerate(indexed)]
                size = sum(target[j][i] for j in range(len(indexed)))
                out[i] = BlendedDataset(mids, w, size, cache_dir, build, SPLIT_NAMES[i])
    else:
        for i in range(3):
            if wanted[i]:
                mids = [one(ds, i, None) for ds in indexed]
                lengths = [len(m) for m in mids]
                size = min(sizes[i], sum(lengths))
                out[i] = BlendedDataset(mids, lengths, size, cache_dir, build, SPLIT_NAMES[i])
    return tuple(out)
