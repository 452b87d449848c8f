"""The BERT sample map: which sentences of one document form each masked-LM sample, in Megatron's order.

A ``_text_sentence`` dataset stores one sequence per sentence and groups sentences into documents. A
sample is a run of consecutive sentences of one document. For the documents of a split, epoch after epoch:

* a document is used when it has at least ``min_sentences`` sentences (2 with the binary head, else 1)
  and, if it has two or more, none of them is longer than 512 tokens;
* each sample gets a target length: ``max_length`` (the sequence length minus [CLS] and two [SEP]), or,
  with probability about ``short_seq_prob``, a shorter one. The draws come from one 32-bit Mersenne
  Twister seeded with ``seed`` (``std::mt19937``): with ``ratio = round(1 / short_seq_prob)`` a draw ``r``
  gives ``2 + r % (max_length - 1)`` when ``r % ratio == 0`` and ``max_length`` otherwise. One draw is
  made when a used document starts and one after every sample (the draw after a document's last sample
  goes unused);
* sentences are added until their tokens reach the target, provided at least two sentences stay in the
  document and the sample has ``min_sentences``; otherwise the sample runs to the end of the document;
* with ``num_samples`` given, whole epochs are built until there are at least that many samples (so the
  map may be longer); without it, one epoch.

Each row is ``(first sentence, end sentence (exclusive), target length)``, uint32 (uint64 beyond 2**32
sentences). The rows are then shuffled by Fisher-Yates from the last row down, row ``i`` swapped with row
``r % (i + 1)`` for the next draw ``r`` of a 64-bit Mersenne Twister seeded with ``seed + 1``
(``std::mt19937_64``).

Both generators are reproduced exactly: the 32-bit one is NumPy's ``MT19937`` with its legacy
(``init_genrand``) seeding, which is the C++ standard's seeding; the 64-bit one is written out below and
produces its output in vectorised blocks of 312 words. The target lengths are computed from the draws in
NumPy; the walk (a binary search on cumulative sentence lengths per sample) and the Fisher-Yates swaps are
sequential: a 60-line C loop compiled on first use (``megatron/core/native.py``), or the same loops in
Python without a compiler (identical rows, about 20 times slower).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Iterator, Optional, Tuple

import numpy as np

from megatron.core.native import load_c_library

LONG_SENTENCE_LEN = 512

_U64 = np.uint64
_MASK64 = (1 << 64) - 1


def mt19937_words(seed: int, count: int) -> np.ndarray:
    """The first ``count`` outputs (uint64 holding 32-bit values) of ``std::mt19937(seed)``."""
    gen = np.random.MT19937()
    gen._legacy_seeding(int(seed) & 0xFFFFFFFF)  # init_genrand: the C++ standard's seeding
    return gen.random_raw(count)


class MT19937_64:
    """``std::mt19937_64``: the 64-bit Mersenne Twister (312 words of state), output in vectorised blocks."""

    N, M = 312, 156
    MATRIX_A = _U64(0xB5026F5AA96619E9)
    UPPER = _U64(0xFFFFFFFF80000000)
    LOWER = _U64(0x7FFFFFFF)

    def __init__(self, seed: int):
        state = [int(seed) & _MASK64]
        for i in range(1, self.N):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
        self.state = np.array(state, dtype=np.uint64)
        self._blocks = self.blocks()
        self._left = np.zeros(0, dtype=np.uint64)

    def _mix(self, hi: np.ndarray, lo: np.ndarray, far: np.ndarray) -> np.ndarray:
        x = (hi & self.UPPER) | (lo & self.LOWER)
        odd = (x & _U64(1)).astype(bool)
        return far ^ (x >> _U64(1)) ^ np.where(odd, self.MATRIX_A, _U64(0))

    def _twist(self) -> None:
        s, n, m = self.state, self.N, self.M
        # words 0..n-m-1 read old words only; words n-m..n-2 read words 0.. already renewed; then the last
        s[:n - m] = self._mix(s[:n - m], s[1:n - m + 1], s[m:])
        s[n - m:n - 1] = self._mix(s[n - m:n - 1], s[n - m + 1:], s[:m - 1])
        s[n - 1:] = self._mix(s[n - 1:], s[:1], s[m - 1:m])

    def blocks(self) -> Iterator[np.ndarray]:
        """Successive blocks of 312 tempered outputs (uint64)."""
        while True:
            self._twist()
            y = self.state.copy()
            y ^= (y >> _U64(29)) & _U64(0x5555555555555555)
            y ^= (y << _U64(17)) & _U64(0x71D67FFFEDA60000)
            y ^= (y << _U64(37)) & _U64(0xFFF7EEE000000000)
            y ^= y >> _U64(43)
            yield y

    def words(self, count: int) -> np.ndarray:
        """The next ``count`` outputs (successive calls continue the stream)."""
        parts, have = [self._left], self._left.size
        while have < count:
            block = next(self._blocks)
            parts.append(block)
            have += block.size
        stream = np.concatenate(parts)
        self._left = stream[count:]
        return stream[:count]


_C_SOURCE = r"""
#include <stdint.h>
/* One epoch of the sample walk over used documents; returns the number of rows, *used = draws consumed. */
int64_t walk(const int64_t *firsts, const int64_t *lasts, int64_t ndocs, const int64_t *cum,
             const int64_t *targets, int64_t min_sent, int64_t *rows, int64_t *used) {
    int64_t n = 0, d = 0;
    for (int64_t k = 0; k < ndocs; ++k) {
        int64_t start = firsts[k], last = lasts[k], target = targets[d++];
        for (;;) {
            int64_t want = cum[start] + target, lo = start + 1, hi = last + 1;
            while (lo < hi) {
                int64_t mid = lo + (hi - lo) / 2;
                if (cum[mid] >= want) hi = mid; else lo = mid + 1;
            }
            int64_t end = lo - 1;
            if (end < start + min_sent - 1) end = start + min_sent - 1;
            if (end > last - 3) end = last - 1;
            rows[3 * n] = start; rows[3 * n + 1] = end + 1; rows[3 * n + 2] = target; ++n;
            target = targets[d++];
            start = end + 1;
            if (start == last) break;
        }
    }
    *used = d;
    return n;
}
/* std::mt19937_64 */
typedef struct { uint64_t s[312]; int i; } mt64;
static void mt64_seed(mt64 *g, uint64_t seed) {
    g->s[0] = seed;
    for (int i = 1; i < 312; ++i) g->s[i] = 6364136223846793005ULL * (g->s[i - 1] ^ (g->s[i - 1] >> 62)) + i;
    g->i = 312;
}
static uint64_t mt64_next(mt64 *g) {
    if (g->i >= 312) {
        for (int i = 0; i < 312; ++i) {
            uint64_t x = (g->s[i] & 0xFFFFFFFF80000000ULL) | (g->s[(i + 1) % 312] & 0x7FFFFFFFULL);
            g->s[i] = g->s[(i + 156) % 312] ^ (x >> 1) ^ ((x & 1ULL) ? 0xB5026F5AA96619E9ULL : 0ULL);
        }
        g->i = 0;
    }
    uint64_t y = g->s[g->i++];
    y ^= (y >> 29) & 0x5555555555555555ULL;
    y ^= (y << 17) & 0x71D67FFFEDA60000ULL;
    y ^= (y << 37) & 0xFFF7EEE000000000ULL;
    return y ^ (y >> 43);
}
/* Fisher-Yates from i = n-1 down to 1 with j = draw % (i + 1), draws from std::mt19937_64(seed). */
void fisher_yates(int64_t *order, int64_t n, uint64_t seed) {
    mt64 g;
    mt64_seed(&g, seed);
    for (int64_t i = n - 1; i > 0; --i) {
        int64_t j = (int64_t)(mt64_next(&g) % (uint64_t)(i + 1)), t = order[i];
        order[i] = order[j]; order[j] = t;
    }
}
"""


@functools.lru_cache(maxsize=None)
def _load_c() -> Optional[ctypes.CDLL]:
    lib = load_c_library("bert_samples", _C_SOURCE)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.walk.argtypes = [p, p, i64, p, p, i64, p, p]
    lib.walk.restype = i64
    lib.fisher_yates.argtypes = [p, i64, ctypes.c_uint64]
    return lib


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


class _TargetLengths:
    """Target lengths of successive samples, one ``std::mt19937`` draw each, served in arrays."""

    def __init__(self, seed: int, short_seq_prob: float, max_length: int):
        # C's round(): halves away from zero
        self.ratio = int(math.floor(1.0 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
        self.max_length = max_length
        self.gen = np.random.MT19937()
        self.gen._legacy_seeding(int(seed) & 0xFFFFFFFF)
        self.buffer = np.zeros(0, dtype=np.int64)

    def peek(self, count: int) -> np.ndarray:
        """The next ``count`` targets (not yet consumed)."""
        if self.buffer.size < count:
            missing = count - self.buffer.size
            if self.ratio == 0:
                more = np.full(missing, self.max_length, dtype=np.int64)
            else:
                r = self.gen.random_raw(missing)  # 32-bit draws in uint64
                more = np.where(r % _U64(self.ratio) == 0, 2 + r % _U64(self.max_length - 1),
                                _U64(self.max_length)).astype(np.int64)
            self.buffer = np.concatenate((self.buffer, more))
        return self.buffer[:count]

    def consume(self, count: int) -> None:
        self.buffer = self.buffer[count:]


def _walk_epoch(firsts: np.ndarray, lasts: np.ndarray, cum: np.ndarray, targets: np.ndarray,
                min_sentences: int) -> Tuple[np.ndarray, int]:
    """Rows ``[R, 3]`` of one epoch and the number of target draws used (C loop, or the same loop in Python)."""
    capacity = int((lasts - firsts).sum())  # at most one sample per sentence
    lib = _load_c()
    if lib is not None:
        rows = np.empty((capacity, 3), dtype=np.int64)
        used = ctypes.c_int64(0)
        n = lib.walk(_ptr(firsts), _ptr(lasts), len(firsts), _ptr(cum), _ptr(targets), min_sentences, _ptr(rows),
                     ctypes.byref(used))
        return rows[:n], used.value
    search, tlist, out, d = cum.searchsorted, targets.tolist(), [], 0
    for first, last in zip(firsts.tolist(), lasts.tolist()):
        start, target = first, tlist[d]
        d += 1
        while True:
            # the first sentence s at which the tokens of [start, s] reach the target
            reach = int(search(cum[start] + target, side="left")) - 1
            end = max(reach, start + min_sentences - 1)
            if end > last - 3:  # fewer than two sentences would stay: take the rest of the document
                end = last - 1
            out.append((start, end + 1, target))
            target = tlist[d]
            d += 1
            start = end + 1
            if start == last:
                break
    return np.array(out, dtype=np.int64).reshape(-1, 3), d  # (R, 3)


def build_sample_map(sentence_bounds: np.ndarray, sentence_lengths: np.ndarray, num_samples: Optional[int],
                     max_length: int, short_seq_prob: float, seed: int, min_sentences: int) -> np.ndarray:
    """The shuffled ``[S, 3]`` sample map (see module doc).

    ``sentence_bounds`` (int64[docs + 1]) are the first sentence of each document of the split followed by
    the end of the last one; ``sentence_lengths`` are the token counts of all sentences of the dataset.
    """
    if max_length < 2:
        raise ValueError(f"the target length {max_length} is below 2 tokens")
    bounds = np.asarray(sentence_bounds, dtype=np.int64)
    lengths = np.asarray(sentence_lengths, dtype=np.int64)
    cum = np.concatenate(([0], np.cumsum(lengths)))  # cum[s]: tokens before sentence s
    counts = np.diff(bounds)
    longest = _longest_per_document(lengths, bounds, counts > 0)
    # the long-sentence rule applies to documents of two or more sentences only
    used = (counts >= min_sentences) & ((counts < 2) | (longest <= LONG_SENTENCE_LEN))
    firsts, lasts = np.ascontiguousarray(bounds[:-1][used]), np.ascontiguousarray(bounds[1:][used])
    if firsts.size == 0:
        raise ValueError(f"no document has {min_sentences} or more sentences of at most {LONG_SENTENCE_LEN} "
                         f"tokens, so there is no sample to make")
    targets = _TargetLengths(seed, short_seq_prob, max_length)
    draws_per_epoch = firsts.size + int((lasts - firsts).sum())  # one per used document and per sample, at most
    epochs, total = [], 0
    while True:
        rows, consumed = _walk_epoch(firsts, lasts, cum, targets.peek(draws_per_epoch), min_sentences)
        targets.consume(consumed)
        epochs.append(rows)
        total += rows.shape[0]
        if num_samples is None or total >= num_samples:
            break
    dtype = np.uint32 if lengths.size <= np.iinfo(np.uint32).max else np.uint64
    sample_map = np.concatenate(epochs).astype(dtype)  # (S, 3)
    return sample_map[shuffled_order(sample_map.shape[0], seed + 1)]


def _longest_per_document(lengths: np.ndarray, bounds: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
    """The longest sentence of each document (0 for an empty one)."""
    longest = np.zeros(nonempty.size, dtype=np.int64)
    starts = bounds[:-1][nonempty]
    if starts.size:  # between two non-empty documents' starts lie only the first one's sentences
        longest[nonempty] = np.maximum.reduceat(lengths[:bounds[-1]], starts)
    return longest


def shuffled_order(n: int, seed: int) -> np.ndarray:
    """Fisher-Yates from the last position down, position ``i`` swapped with ``r % (i + 1)`` for successive
    ``std::mt19937_64(seed)`` draws ``r``: the order in which rows end up."""
    order = np.arange(n, dtype=np.int64)
    lib = _load_c()
    if lib is not None:
        lib.fisher_yates(_ptr(order), n, int(seed) & _MASK64)
        return order
    gen, items, top = MT19937_64(seed), order.tolist(), n - 1
    while top > 0:
        count = min(312 * 4096, top)
        span = np.arange(top + 1, top + 1 - count, -1, dtype=np.uint64)  # i + 1 for i = top, top-1, ...
        for i, j in zip(range(top, top - count, -1), (gen.words(count) % span).tolist()):
            items[i], items[j] = items[j], items[i]
        top -= count
    return np.array(items, dtype=np.int64)
