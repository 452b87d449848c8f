"""Blending indices: which dataset (and which of its samples) each blended sample comes from.

Megatron's rule is a greedy error-minimising interleave: sample ``t`` goes to the dataset ``i`` with the
largest ``weights[i] * max(t, 1) - taken[i]`` (the first such ``i`` on ties), and is that dataset's sample
number ``taken[i]``. The "exhaustive" variant (no target size) draws exactly ``sizes[i]`` samples from each
dataset, in proportion to the sizes, skipping datasets that are used up.

The loop is inherently sequential. A 25-line C version is compiled on first use with the system C
compiler (``cc``) into a per-user cache and loaded with ``ctypes``; without a compiler the same loop runs
in Python (identical results, slower: about a second per million samples). Floating-point contraction
is disabled so the C arithmetic equals Python's (and Megatron's) double arithmetic bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Optional, Sequence, Tuple

import numpy as np

from megatron.core.native import load_c_library

_C_SOURCE = r"""
#include <stdint.h>
void blend(const double *w, int32_t n, int64_t size, int16_t *ds, int64_t *ds_sample, int64_t *taken) {
    for (int32_t i = 0; i < n; ++i) taken[i] = 0;
    for (int64_t t = 0; t < size; ++t) {
        double td = t > 1 ? (double)t : 1.0;
        int32_t best = 0;
        double best_err = w[0] * td - (double)taken[0];
        for (int32_t i = 1; i < n; ++i) {
            double err = w[i] * td - (double)taken[i];
            if (err > best_err) { best_err = err; best = i; }
        }
        ds[t] = (int16_t)best; ds_sample[t] = taken[best]; taken[best] += 1;
    }
}
void blend_exhaustive(const int64_t *sizes, const double *w, int32_t n, int64_t total,
                      int16_t *ds, int64_t *ds_sample, int64_t *taken) {
    for (int32_t i = 0; i < n; ++i) taken[i] = 0;
    for (int64_t t = 0; t < total; ++t) {
        double td = t > 1 ? (double)t : 1.0;
        int32_t best = -1;
        double best_err = 0.0;
        for (int32_t i = 0; i < n; ++i) {
            if (taken[i] >= sizes[i]) continue;
            double err = w[i] * td - (double)taken[i];
            if (best < 0 || err > best_err) { best_err = err; best = i; }
        }
        ds[t] = (int16_t)best; ds_sample[t] = taken[best]; taken[best] += 1;
    }
}
"""

@functools.lru_cache(maxsize=None)
def _load_c() -> Optional[ctypes.CDLL]:
    """Compile (once per user and source version) and load the C loop, once per process; None when impossible."""
    lib = load_c_library("blending", _C_SOURCE, extra_flags=("-ffp-contract=off",))
    if lib is None:
        return None
    p = ctypes.c_void_p
    lib.blend.argtypes = [p, ctypes.c_int32, ctypes.c_int64, p, p, p]
    lib.blend_exhaustive.argtypes = [p, p, ctypes.c_int32, ctypes.c_int64, p, p, p]
    return lib


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[size], dataset_sample_index int64[size]) for normalised ``weights``."""
    w = np.ascontiguousarray(weights, dtype=np.float64)
    n = len(w)
    ds = np.zeros(size, dtype=np.int16)
    ds_sample = np.zeros(size, dtype=np.int64)
    lib = _load_c()
    if lib is not None:
        taken = np.zeros(n, dtype=np.int64)
        lib.blend(_ptr(w), n, size, _ptr(ds), _ptr(ds_sample), _ptr(taken))
        return ds, ds_sample
    wl = w.tolist()
    taken = [0] * n
    rng = range(1, n)
    for t in range(size):
        td = float(t) if t > 1 else 1.0
        best, best_err = 0, wl[0] * td - taken[0]
        for i in rng:
            err = wl[i] * td - taken[i]
            if err > best_err:
                best, best_err = i, err
        ds[t] = best
        ds_sample[t] = taken[best]
        taken[best] += 1
    return ds, ds_sample


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Indices drawing exactly ``sizes[i]`` samples from dataset ``i`` (no target size given)."""
    s = np.ascontiguousarray(sizes, dtype=np.int64)
    n, total = len(s), int(s.sum())
    w = np.ascontiguousarray([int(x) / float(total) for x in s.tolist()], dtype=np.float64) if total else \
        np.zeros(n, dtype=np.float64)
    ds = np.zeros(total, dtype=np.int16)
    ds_sample = np.zeros(total, dtype=np.int64)
    lib = _load_c()
    if lib is not None:
        taken = np.zeros(n, dtype=np.int64)
        lib.blend_exhaustive(_ptr(s), _ptr(w), n, total, _ptr(ds), _ptr(ds_sample), _ptr(taken))
        return ds, ds_sample
    wl, sl = w.tolist(), s.tolist()
    taken = [0] * n
    for t in range(total):
        td = float(t) if t > 1 else 1.0
        best, best_err = -1, 0.0
        for i in range(n):
            if taken[i] >= sl[i]:
                continue
            err = wl[i] * td - taken[i]
            if best < 0 or err > best_err:
                best, best_err = i, err
        ds[t] = best
        ds_sample[t] = taken[best]
        taken[best] += 1
    return ds, ds_sample


if __name__ == "__main__":  # pragma: no cover - prints whether the C loop is available
    print("C helper:", "available" if _load_c() is not None else "unavailable (Python loop)", file=sys.stderr)
