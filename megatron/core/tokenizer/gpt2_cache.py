"""On-disk cache of the tables that bulk GPT-2 encoding derives from the tokenizer files alone.

Building them costs about 0.15 s per run (reading merges.txt to check tiktoken's rule, the byte-level
ranks, hashing the vocabulary to seed the piece cache, and the hashing powers for a chunk), which is a
large share of preprocessing a small file. They depend only on the contents of ``vocab.json`` and
``merges.txt`` (and on constants of this code), never on the input being preprocessed, so they are saved
once per machine like a compiled tokenizer, under ``$XDG_CACHE_HOME/megatron-lite`` (else
``~/.cache/megatron-lite``), as ``.npy`` files read without pickle. A missing, unreadable or mismatching
cache is rebuilt; a read-only home only means rebuilding every time.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, Optional, Tuple

import numpy as np

from megatron.core.native import cache_dir

FORMAT = 2  # bump when what is stored, or how it is computed, changes


def files_key(*paths: str, extra: str = "") -> str:
    """Hex digest of the files' contents (plus ``extra``): the cache key."""
    h = hashlib.sha256(f"{FORMAT}|{extra}".encode())
    for p in paths:
        with open(p, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:32]


def load(name: str, mmap: bool = False) -> Optional[np.ndarray]:
    """The cached array ``name`` or None (absent or unreadable)."""
    try:
        return np.load(os.path.join(cache_dir(), name + ".npy"), mmap_mode="r" if mmap else None,
                       allow_pickle=False)
    except (OSError, ValueError):
        return None


def save(name: str, array: np.ndarray) -> None:
    """Store ``array`` as ``name`` atomically (written aside, then renamed); failures are ignored."""
    path = os.path.join(cache_dir(), name + ".npy")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass


def hash_bases() -> Tuple[int, int]:
    """The two odd 64-bit bases of the piece hashes: random, drawn once per machine and user and kept here.

    Polynomial hashes modulo 2**64 with known bases can be made to collide on purpose (lattice reduction
    finds such strings), and a collision of both hashes would give a piece another piece's ids: secret bases
    take that away. (Collisions that work for every base need pieces far longer than the encoder caches.)
    Where the cache folder is not writable, the bases are drawn afresh for every process.
    """
    global _BASES
    if _BASES is None:
        arr = load("gpt2_hash_bases")
        if arr is None or arr.shape != (2,) or arr.dtype != np.uint64 or not all(int(x) & 1 for x in arr):
            arr = np.frombuffer(os.urandom(16), dtype=np.uint64) | np.uint64(1)
            save("gpt2_hash_bases", arr)
        _BASES = (int(arr[0]), int(arr[1]))
    return _BASES


_BASES: Optional[Tuple[int, int]] = None


def pack_ranks(ranks: Dict[bytes, int]) -> np.ndarray:
    """``{token bytes: id}`` -> one uint8 array: [count as 8 bytes][ids as int64][ends as int64][bytes]."""
    tokens = list(ranks)
    ids = np.fromiter((ranks[t] for t in tokens), dtype=np.int64, count=len(tokens))
    ends = np.cumsum(np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)))
    head = np.array([len(tokens)], dtype=np.int64)
    blob = np.frombuffer(b"".join(tokens), dtype=np.uint8)
    return np.concatenate([head.view(np.uint8), ids.view(np.uint8), ends.view(np.uint8), blob])


def unpack_ranks(packed: np.ndarray) -> Dict[bytes, int]:
    """Inverse of ``pack_ranks``."""
    n = int(packed[:8].view(np.int64)[0])
    ids = packed[8: 8 + 8 * n].view(np.int64).tolist()
    ends = packed[8 + 8 * n: 8 + 16 * n].view(np.int64).tolist()
    blob = packed[8 + 16 * n:].tobytes()
    starts = [0] + ends[:-1]
    return {blob[a:b]: i for a, b, i in zip(starts, ends, ids)}


def powers(p: int, inv: int, m: int) -> Tuple[np.ndarray, np.ndarray]:
    """P**j and P**-j modulo 2**64 for j < m (uint64), memory-mapped from the cache when there.

    Mapped pages come from the page cache and are shared by every process, instead of being allocated,
    zeroed and filled in each run.
    """
    name = f"powers_{p:016x}_{m}"
    arr = load(name, mmap=True)
    if arr is None or arr.shape != (2, m) or arr.dtype != np.uint64:
        arr = np.empty((2, m), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for row, base in enumerate((p, inv)):
                arr[row] = np.uint64(base)
                arr[row, 0] = 1
                np.cumprod(arr[row], out=arr[row])
        save(name, arr)
    return arr[0], arr[1]
