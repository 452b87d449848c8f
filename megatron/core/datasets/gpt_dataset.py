"""GPT dataset: fixed-length samples cut from shuffled documents, in Megatron-Core's exact order.

For the documents of one split (a contiguous range of document ids chosen by ``--split``) and a requested
number of samples ``num_samples``:

1. **Epochs.** An epoch is every document of the split once (``T`` tokens). The number of epochs ``E`` is
   the least with ``E * T >= num_samples * seq_length + 1``.
2. **Document index** (int32[E * docs]). The document ids repeated ``E`` times and shuffled with
   ``numpy.random.RandomState(seed)``. When ``E > 1`` and the last epoch would contribute fewer than
   80% of an epoch's samples, the first ``E - 1`` epochs are shuffled together and the last epoch is
   shuffled on its own (so a tiny last epoch is not spread over the whole run).
3. **Sample index** (int32 or int64 [S + 1, 2]). The shuffled documents are read as one token stream;
   sample ``k`` is the ``seq_length + 1`` tokens starting at stream position ``k * seq_length`` (samples
   overlap by one token: the last token of a sample is the first of the next). Row ``k`` holds the
   position in the document index and the offset inside that document where sample ``k`` starts,
   ``S = (E * T - 1) // seq_length``. Built with vectorised NumPy (``searchsorted`` on the cumulative
   document lengths) instead of Megatron's C++ loop; the rows are identical.
4. **Shuffle index** (uint32, int64 when huge). A permutation of the samples from the same generator;
   with a separate last epoch the samples of the first ``E - 1`` epochs and those of the last are
   permuted separately and concatenated.

Item ``i`` is ``{"text": int64[seq_length + 1]}``: sample ``shuffle_index[i]``.

The three indices are saved as ``.npy`` under a cache directory, named by a hash of everything that
determines them (``index_cache.py``); one rank builds them and the others memory-map them (see
``builder.build_gpt_datasets``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Dict, Optional, Tuple

import numpy as np

from megatron.core.datasets.index_cache import IndexCache, description_hash
from megatron.core.datasets.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

LAST_EPOCH_THRESHOLD = 0.80
_INDEX_FORMAT = "megatron-lite-gpt-v1"
_INDEX_KEYS = ("document_index", "sample_index", "shuffle_index")


def num_epochs_for(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int) -> int:
    """Least number of epochs whose tokens cover ``num_samples`` samples (1 when ``num_samples`` is None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_last_epoch(num_epochs: int, tokens_per_epoch: int, num_samples: int, seq_length: int) -> bool:
    """Whether the last epoch is shuffled apart: it contributes under 80% of an epoch's samples."""
    if num_epochs == 1:
        return False
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - 1) // seq_length
    if not 0 <= from_last <= per_epoch + 1:
        raise AssertionError(f"inconsistent epoch arithmetic: {from_last} samples from the last epoch")
    return from_last < int(LAST_EPOCH_THRESHOLD * per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_last: bool) -> np.ndarray:
    """Document ids repeated ``num_epochs`` times and shuffled (int32)."""
    if not separate_last or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int) -> np.ndarray:
    """[S + 1, 2] rows (position in ``document_index``, token offset) where each sample starts."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_lens = np.asarray(sizes, dtype=np.int64)[document_index]  # [E * docs]
    ends = np.cumsum(doc_lens)  # exclusive end of every document in the token stream
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length  # [S + 1]
    where = np.searchsorted(ends, positions, side="right")  # first document ending after the position
    offsets = positions - (ends[where] - doc_lens[where])
    dtype = np.int32 if max(len(document_index), int(np.max(sizes, initial=0))) <= np.iinfo(np.int32).max \
        else np.int64
    index = np.empty((num_samples + 1, 2), dtype=dtype)
    index[:, 0] = where
    index[:, 1] = offsets
    index[0] = (0, 0)  # Megatron starts at the first document even when it is empty
    return index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: Optional[int], seq_length: int,
                  seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) of one split, as Megatron-Core builds them."""
    tokens_per_epoch = int(np.asarray(sizes, dtype=np.int64)[documents].sum())
    if tokens_per_epoch <= 1:
        raise ValueError(f"it has {tokens_per_epoch} tokens; at least 2 are needed to make a sample")
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    separate = num_samples is not None and separate_last_epoch(num_epochs, tokens_per_epoch, num_samples,
                                                                 seq_length)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch)
    total = sample_index.shape[0] - 1
    if separate:
        before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        shuffle_index = build_shuffle_index(before_last, total, rng)
    else:
        shuffle_index = build_shuffle_index(total, total, rng)
    return document_index, sample_index, shuffle_index


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from the documents ``documents`` of ``indexed``.

    ``cache_dir`` (optional) holds the indices as ``.npy``; ``build`` says whether this process may build
    and write them on a cache miss (rank 0) or must find them there (other ranks, after a barrier; they
    fall back to building in memory if the files are missing).
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: Optional[int],
                 seq_length: int, seed: int, split: str = "train", cache_dir: Optional[str] = None,
                 build: bool = True):
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
        self.indexed = indexed
        self.documents = np.asarray(documents, dtype=np.int32)
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.seed = seed
        self.split = split
        self.description = {
            "format": _INDEX_FORMAT,
            "class": "GPTDataset",
            "path_prefix": os.path.abspath(indexed.path_prefix),
            "sequences": len(indexed),
            "tokens": int(indexed.sequence_lengths.sum(dtype=np.int64)),
            "split": split,
            "documents": [int(self.documents[0]), int(self.documents[-1]) + 1] if self.documents.size else [0, 0],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
        }
        self.hash = description_hash(self.description)
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(cache_dir, build)

    def _load_or_build(self, cache_dir: Optional[str], build: bool):
        cache = IndexCache(cache_dir, self.description, "GPTDataset", self.split, _INDEX_KEYS)
        arrays = cache.load_or_build(self._build_indices, may_save=build)
        return tuple(arrays[k] for k in _INDEX_KEYS)

    def _build_indices(self) -> Dict[str, np.ndarray]:
        t0 = time.time()
        try:
            indices = build_indices(self.indexed.sequence_lengths, self.documents, self.num_samples,
                                    self.seq_length, self.seed)
        except ValueError as err:
            beg, end = self.description["documents"]
            raise ValueError(f"the {self.split} split of {self.indexed.path_prefix} (documents [{beg}, {end})): "
                             f"{err}; give it a larger share in --split") from None
        logger.info("built GPTDataset %s indices (%d samples) in %.2f s", self.split, len(indices[2]),
                    time.time() - t0)
        return dict(zip(_INDEX_KEYS, indices))

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def get_sample(self, idx: int) -> np.ndarray:
        """The tokens (int64[seq_length + 1]) of item ``idx`` (after the shuffle)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples ({self.split})")
        s = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(x) for x in self.sample_index[s])
        doc_end, off_end = (int(x) for x in self.sample_index[s + 1])
        if doc_beg == doc_end:
            return self.indexed.get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1).astype(np.int64)
        parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg)]
        for i in range(doc_beg + 1, doc_end):
            parts.append(self.indexed.get(int(self.document_index[i])))
        parts.append(self.indexed.get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx) -> Dict[str, np.ndarray]:
        return {"text": self.get_sample(int(idx))}

