"""Small C loops for the bulk GPT-2 encoder: hash every piece and find it in the piece cache in one pass, and
copy out the cached ids of every piece.

``gpt2_fast.FastGPT2Encoder`` hashes pieces with prefix sums and probes its hash table with vectorised NumPy,
which reads every code point several times; this loop reads each once and probes the table directly, giving
the very same hashes and rows (the tests compare both). It is compiled on first use with the system's C
compiler (``cc``, or ``$CC``) into the per-user cache folder and loaded with ``ctypes``, as
``megatron/core/datasets/blending.py`` does; without a compiler, or with ``MEGATRON_NO_C_HELPERS=1``, the
NumPy path runs instead.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional, Tuple

import numpy as np

from megatron.core.native import load_c_library

_C_SOURCE = r"""
#include <stdint.h>

/* For every piece [starts[i], ends[i]) of the code points cp: the two hashes sum_j cp[j] * P**(j - start)
   + length * lenmul (mod 2**64; a first hash of 0 becomes 1), and its row in an open-addressing table
   (linear probing from (k1 * mix) >> (64 - bits); key 0 = empty slot), or -1. Returns how many found
   pieces have a second hash different from the row's (a collision of first hashes). */
int64_t hash_find(const uint32_t *cp, const int64_t *starts, const int64_t *ends, int64_t npieces,
                  uint64_t p1, uint64_t p2, uint64_t lenmul, uint64_t mix,
                  const uint64_t *tkeys, const int64_t *trows, const uint64_t *rowk2, int32_t bits,
                  uint64_t *k1, uint64_t *k2, int64_t *row) {
    const uint64_t mask = (((uint64_t)1) << bits) - 1;
    int64_t bad = 0;
    for (int64_t i = 0; i < npieces; i++) {
        uint64_t h1 = 0, h2 = 0, w1 = 1, w2 = 1;
        const int64_t e = ends[i];
        for (int64_t j = starts[i]; j < e; j++) {
            const uint64_t c = cp[j];
            h1 += c * w1;
            h2 += c * w2;
            w1 *= p1;
            w2 *= p2;
        }
        const uint64_t len = (uint64_t)(e - starts[i]);
        h1 += len * lenmul;
        h2 += len * lenmul;
        if (h1 == 0) h1 = 1;
        k1[i] = h1;
        k2[i] = h2;
        uint64_t s = (h1 * mix) >> (64 - bits);
        int64_t r = -1;
        for (;;) {
            const uint64_t k = tkeys[s];
            if (k == h1) { r = trows[s]; break; }
            if (k == 0) break;
            s = (s + 1) & mask;
        }
        if (r >= 0 && rowk2[r] != h2) bad++;
        row[i] = r;
    }
    return bad;
}

/* The ids of every piece occurrence back to back: ids[off[row[i]] : off[row[i]] + len[row[i]]] for each i. */
void gather_ids(const int64_t *row, int64_t npieces, const int64_t *off, const int64_t *len, const int64_t *ids,
                int64_t *out) {
    int64_t k = 0;
    for (int64_t i = 0; i < npieces; i++) {
        const int64_t *src = ids + off[row[i]];
        const int64_t l = len[row[i]];
        for (int64_t j = 0; j < l; j++) out[k++] = src[j];
    }
}
"""

@functools.lru_cache(maxsize=None)
def load() -> Optional[ctypes.CDLL]:
    """Compile (once per user and source version) and load the loop, once per process; None when impossible or
    disabled."""
    lib = load_c_library("gpt2_pieces", _C_SOURCE)
    if lib is None:
        return None
    p, u64 = ctypes.c_void_p, ctypes.c_uint64
    lib.hash_find.argtypes = [p, p, p, ctypes.c_int64, u64, u64, u64, u64, p, p, p, ctypes.c_int32, p, p, p]
    lib.hash_find.restype = ctypes.c_int64
    lib.gather_ids.argtypes = [p, ctypes.c_int64, p, p, p, p]
    lib.gather_ids.restype = None
    return lib


def hash_find(lib: ctypes.CDLL, cp: np.ndarray, starts: np.ndarray, ends: np.ndarray, p1: int, p2: int,
              lenmul: int, mix: int, keys: np.ndarray, rows: np.ndarray, row_k2: np.ndarray, bits: int
              ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(k1, k2, row per piece, number of first-hash collisions) for the pieces of ``cp`` (see the C source)."""
    cp = np.ascontiguousarray(cp, dtype=np.uint32)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    row_k2 = np.ascontiguousarray(row_k2 if row_k2.size else np.zeros(1, np.uint64), dtype=np.uint64)
    m = starts.size
    k1, k2, row = np.empty(m, np.uint64), np.empty(m, np.uint64), np.empty(m, np.int64)
    ptr = ctypes.c_void_p
    bad = lib.hash_find(ptr(cp.ctypes.data), ptr(starts.ctypes.data), ptr(ends.ctypes.data), m, p1, p2, lenmul,
                        mix, ptr(keys.ctypes.data), ptr(rows.ctypes.data), ptr(row_k2.ctypes.data), bits,
                        ptr(k1.ctypes.data), ptr(k2.ctypes.data), ptr(row.ctypes.data))
    return k1, k2, row, int(bad)


def gather_ids(lib: ctypes.CDLL, row: np.ndarray, total: int, off: np.ndarray, lens: np.ndarray,
               ids: np.ndarray) -> np.ndarray:
    """int64[total]: the cached ids of the pieces ``row`` back to back (``total``: their number of ids)."""
    row = np.ascontiguousarray(row, dtype=np.int64)
    out = np.empty(total, dtype=np.int64)
    ptr = ctypes.c_void_p
    lib.gather_ids(ptr(row.ctypes.data), row.size, ptr(off.ctypes.data), ptr(lens.ctypes.data),
                   ptr(ids.ctypes.data), ptr(out.ctypes.data))
    return out
