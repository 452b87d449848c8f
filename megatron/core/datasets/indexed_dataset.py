"""Megatron's memory-mapped token dataset: a ``.bin`` of token ids and an ``.idx`` describing it.

Format (little-endian, no padding), byte-compatible with Megatron-LM / Megatron-Core:

``.idx``
    9 bytes   magic ``b"MMIDIDX\\x00\\x00"``
    u64       version, 1
    u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    u64       S, the number of sequences
    u64       D, the length of the document index (documents + 1)
    int32[S]  sequence lengths (in tokens)
    int64[S]  byte offset of each sequence in ``.bin``
    int64[D]  document boundaries as sequence indices: 0, ..., S

``.bin``
    the token ids of all sequences back to back, in the dtype of the ``.idx``.

A document is one sequence unless sentences were split (then one sequence per sentence). The writer
writes ``NAME.bin.tmp`` and ``NAME.idx.tmp`` and renames both only in ``finalize``, so an interrupted run
never leaves a ``.bin``/``.idx`` pair that looks complete.
"""

from __future__ import annotations

import os
import shutil
import struct
from typing import Optional, Sequence, Union

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """Token dtype Megatron picks for a vocabulary: uint16 below 65,500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    """True when both ``PREFIX.idx`` and ``PREFIX.bin`` exist."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexReader:
    """The parsed ``.idx``: dtype, sequence lengths/pointers and document boundaries (all mmapped)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE or head[:9] != MAGIC:
            raise ValueError(f"{path}: not a Megatron .idx file (bad magic {head[:9]!r})")
        version, code, s, d = struct.unpack("<QBQQ", head[9:])
        if version != VERSION:
            raise ValueError(f"{path}: .idx version {version} is not supported (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{path}: unknown dtype code {code}")
        self.path = path
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + s * 4 + s * 8 + d * 8
        size = os.path.getsize(path)
        if size != expected:
            raise ValueError(f"{path}: size {size} bytes, expected {expected} for {s} sequences and {d} boundaries")
        self._mmap = np.memmap(path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._mmap, dtype=np.int32, count=s, offset=off)
        off += s * 4
        self.sequence_pointers = np.frombuffer(self._mmap, dtype=np.int64, count=s, offset=off)
        off += s * 8
        self.document_indices = np.frombuffer(self._mmap, dtype=np.int64, count=d, offset=off)
        docs = self.document_indices
        if len(docs) and (docs[0] != 0 or docs[-1] != s or np.any(np.diff(docs) < 0)):
            raise ValueError(f"{path}: corrupt index: the document boundaries do not rise from 0 to the {s} "
                             "sequences")

    def __len__(self) -> int:
        return len(self.sequence_lengths)


class IndexedDataset:
    """Read-only view of ``PREFIX.bin``/``PREFIX.idx``.

    ``ds[i]`` is sequence ``i`` as a NumPy array (a view into the mmapped ``.bin``); ``ds.get(i, offset,
    length)`` a slice of it. ``sequence_lengths`` (int32[S]) and ``document_indices`` (int64[D]) come from
    the index.
    """

    def __init__(self, path_prefix: str):
        if not dataset_exists(path_prefix):
            raise ValueError(
                f"dataset prefix {path_prefix!r}: expected {idx_path(path_prefix)} and {bin_path(path_prefix)}"
            )
        self.path_prefix = path_prefix
        self.index = IndexReader(idx_path(path_prefix))
        self.dtype = self.index.dtype
        nbytes = os.path.getsize(bin_path(path_prefix))
        self._check_sequences(nbytes)
        self._bin = np.memmap(bin_path(path_prefix), mode="r", dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)

    def _check_sequences(self, nbytes: int) -> None:
        """Every sequence of the index lies inside the ``.bin`` (in any order): a damaged ``.idx`` body or a
        truncated ``.bin`` names the file and the first sequence out of place. One vectorised pass at open."""
        lengths, pointers = self.index.sequence_lengths, self.index.sequence_pointers
        ends = pointers + lengths.astype(np.int64) * self.dtype.itemsize
        bad = np.flatnonzero((lengths < 0) | (pointers < 0) | (ends > nbytes))
        if not bad.size:
            return
        i = int(bad[0])
        if lengths[i] >= 0 and pointers[i] >= 0 and ends.max() == ends[-1] and np.all(np.diff(ends) >= 0):
            raise ValueError(f"{bin_path(self.path_prefix)}: {nbytes} bytes, but the index needs {int(ends[-1])}")
        raise ValueError(f"{self.index.path}: corrupt index: sequence {i} (length {int(lengths[i])}, at byte "
                         f"{int(pointers[i])}) does not lie inside the {nbytes} bytes of {bin_path(self.path_prefix)}")

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    def __len__(self) -> int:
        return len(self.index)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when ``length`` is None)."""
        seq_len = int(self.index.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"sequence {idx} has {seq_len} tokens; asked for [{offset}, {offset + length})")
        ptr = int(self.index.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=ptr)

    def __getitem__(self, idx: Union[int, np.integer]) -> np.ndarray:
        if isinstance(idx, slice):
            raise TypeError("IndexedDataset supports integer indices; use get() for slices of a sequence")
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence index {idx} out of range for {len(self)} sequences")
        return self.get(idx)


def write_index(path: str, dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an ``.idx`` for the given sequence lengths and document boundaries."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[dtype], len(lengths), len(docs)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))


class _GrowableInts:
    """An append-only int64 array (amortised doubling) for sequence lengths and boundaries."""

    def __init__(self, first: Sequence[int] = ()):
        self._a = np.zeros(max(1024, len(first)), dtype=np.int64)
        self._n = 0
        self.extend(first)

    def extend(self, values) -> None:
        v = np.asarray(values, dtype=np.int64).reshape(-1)
        need = self._n + len(v)
        if need > len(self._a):
            grown = np.zeros(max(need, 2 * len(self._a)), dtype=np.int64)
            grown[: self._n] = self._a[: self._n]
            self._a = grown
        self._a[self._n: need] = v
        self._n = need

    def append(self, value: int) -> None:
        self.extend((value,))

    def __len__(self) -> int:
        return self._n

    def array(self) -> np.ndarray:
        return self._a[: self._n]


class IndexedDatasetBuilder:
    """Writer of ``.bin``/``.idx`` pairs.

    ``add_item(tokens)`` appends one sequence; ``end_document()`` closes the current document;
    ``add_document(tokens, lengths)`` does both for a document made of consecutive sequences;
    ``add_index(prefix)`` appends a whole existing dataset; ``finalize(idx_path)`` writes the index and
    renames the temporary files into place. ``abort()`` removes the temporary files.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no .idx code")
        self.bin_path = bin_path
        self._tmp_bin = bin_path + ".tmp"
        # An older pair under the same name would look complete next to a half-written new one: drop it.
        if bin_path.endswith(".bin"):
            for old in (bin_path, bin_path[:-4] + ".idx"):
                if os.path.exists(old):
                    os.remove(old)
        self._data = open(self._tmp_bin, "wb")
        self.sequence_lengths = _GrowableInts()
        self.document_indices = _GrowableInts([0])
        self._finalized = False

    def add_item(self, tokens) -> None:
        """Append one sequence (any array-like of ids, e.g. a list, NumPy array or torch tensor)."""
        if hasattr(tokens, "numpy"):
            tokens = tokens.numpy()
        arr = np.asarray(tokens, dtype=self.dtype).reshape(-1)
        self._data.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append a document of ``len(lengths)`` sequences whose ids are ``tokens`` back to back."""
        arr = np.asarray(tokens, dtype=self.dtype).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != arr.size:
            raise ValueError(f"document lengths sum to {int(lengths.sum())} but {arr.size} tokens were given")
        self._data.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        """Append many documents at once: ``tokens`` back to back, ``lengths`` per sequence and
        ``seqs_per_doc`` the number of sequences of each document (0 for an empty document)."""
        arr = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._data.write(arr.tobytes(order="C"))
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths)
        self.document_indices.extend(base + np.cumsum(np.asarray(seqs_per_doc, dtype=np.int64)))

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the previous boundary)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of the dataset at ``path_prefix`` (same dtype required)."""
        index = IndexReader(idx_path(path_prefix))
        if index.dtype != self.dtype:
            raise ValueError(f"{path_prefix}: dtype {index.dtype} differs from the builder's {self.dtype}")
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(index.sequence_lengths)
        self.document_indices.extend(base + np.asarray(index.document_indices[1:]))
        del index
        with open(bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._data, length=16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Write ``idx_path`` and move both files into place (index last)."""
        self._data.close()
        tmp_idx = idx_path + ".tmp"
        write_index(tmp_idx, self.dtype, self.sequence_lengths.array(), self.document_indices.array())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, idx_path)
        self._finalized = True

    def abort(self) -> None:
        """Drop the partial output (temporary files); nothing complete-looking is left behind."""
        if not self._data.closed:
            self._data.close()
        if not self._finalized and os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)
