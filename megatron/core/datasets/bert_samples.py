"""The BERT sample map: which sentences of one document form each masked-LM sample, in Megatron's order.

A ``_text_sentence`` dataset stores one sequence per sentence and groups sentences into documents. A
sample is a run of consecutive sentences of one document. For the documents of a split, epoch after epoch:

* a document is used when it has at least ``min_sentences`` sentences (2 with the binary head, else 1)
  and none of them is longer than 512 tokens;
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
produces its output in vectorised blocks of 312 words. The walk itself costs O(1) per sample (a binary
search on cumulative sentence lengths), in Python: about a second per million samples.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np

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
        out = np.empty(count, dtype=np.uint64)
        done = 0
        for block in self.blocks():
            if done >= count:
                break
            take = min(count - done, block.size)
            out[done:done + take] = block[:take]
            done += take
        return out


class _TargetLengths:
    """The target lengths of successive samples (one ``std::mt19937`` draw each), drawn in chunks."""

    CHUNK = 1 << 16

    def __init__(self, seed: int, short_seq_prob: float, max_length: int):
        # C's round(): halves away from zero
        self.ratio = int(math.floor(1.0 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
        self.max_length = max_length
        self.gen = np.random.MT19937()
        self.gen._legacy_seeding(int(seed) & 0xFFFFFFFF)
        self.buffer, self.pos = [], 0

    def next(self) -> int:
        if self.ratio == 0:
            return self.max_length
        if self.pos == len(self.buffer):
            r = self.gen.random_raw(self.CHUNK)  # uint64 holding 32-bit draws
            short = r % _U64(self.ratio) == 0
            self.buffer = np.where(short, 2 + r % _U64(self.max_length - 1), self.max_length).tolist()
            self.pos = 0
        self.pos += 1
        return self.buffer[self.pos - 1]


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
    firsts, lasts = bounds[:-1][used].tolist(), bounds[1:][used].tolist()
    if not firsts:
        raise ValueError(f"no document has {min_sentences} or more sentences of at most {LONG_SENTENCE_LEN} "
                         f"tokens, so there is no sample to make")
    targets = _TargetLengths(seed, short_seq_prob, max_length)
    search = cum.searchsorted
    rows = []
    while True:
        for first, last in zip(firsts, lasts):
            start = first
            target = targets.next()
            while True:
                # first sentence s at which the tokens of [start, s] reach the target
                reach = int(search(cum[start] + target, side="left")) - 1
                end = max(reach, start + min_sentences - 1)
                if end > last - 3:  # fewer than two sentences would stay: take the rest of the document
                    end = last - 1
                rows.append((start, end + 1, target))
                target = targets.next()
                start = end + 1
                if start == last:
                    break
        if num_samples is None or len(rows) >= num_samples:
            break
    dtype = np.uint32 if lengths.size <= np.iinfo(np.uint32).max else np.uint64
    sample_map = np.array(rows, dtype=dtype).reshape(-1, 3)  # (S, 3)
    return shuffle_rows(sample_map, seed + 1)


def _longest_per_document(lengths: np.ndarray, bounds: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
    """The longest sentence of each document (0 for an empty one)."""
    longest = np.zeros(nonempty.size, dtype=np.int64)
    starts = bounds[:-1][nonempty]
    if starts.size:  # between two non-empty documents' starts lie only the first one's sentences
        longest[nonempty] = np.maximum.reduceat(lengths[:bounds[-1]], starts)
    return longest


def shuffle_rows(rows: np.ndarray, seed: int) -> np.ndarray:
    """Fisher-Yates from the last row down with ``std::mt19937_64(seed)`` draws taken modulo ``i + 1``."""
    n = rows.shape[0]
    if n < 2:
        return rows
    draws = MT19937_64(seed).words(n - 1)
    span = np.arange(n, 1, -1, dtype=np.uint64)  # i + 1 for i = n-1 .. 1
    swaps = (draws % span).tolist()
    order = list(range(n))
    for i, j in zip(range(n - 1, 0, -1), swaps):
        order[i], order[j] = order[j], order[i]
    return rows[np.array(order, dtype=np.int64)]
