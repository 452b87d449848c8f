"""Masked-LM predictions of one token sequence, drawing from the sample's ``numpy.random.RandomState``.

The order and kind of every draw follows Megatron-Core's masked WordPiece datasets, so that the same
generator state gives the same masks:

1. **Candidates.** Every position except [CLS]/[SEP] is a candidate. With whole-word masking a WordPiece
   continuation (a token spelled ``##...``) joins the candidate before it, so a word is masked whole;
   without it every position is its own candidate.
2. **Budget.** ``n = min(mask_prob * target_length, max(1, round(len(tokens) * mask_prob)))`` positions
   at most (Python's ``round``).
3. **N-grams.** The candidates are put in a random order (``shuffle`` of their indices). For each one in
   that order, while fewer than ``n`` positions are masked, an n-gram size is drawn (``choice`` of 1..N
   with probabilities proportional to 1/n, reversed with ``use_longer_ngrams``, or a geometric draw with
   p = 0.2 capped at N); the n-gram is the candidate and the ones after it in position order. If it would
   overshoot the budget, shorter n-grams of the same start are tried down to 1; a candidate whose 1-gram
   overshoots is skipped, and so is an n-gram touching an already masked position.
4. **Replacement.** Each masked position becomes [MASK] with probability 0.8; otherwise, with
   probability 0.5, a token drawn uniformly from the whole vocabulary; otherwise it keeps its token.

Returns the masked tokens and the masked positions (ascending) with their original tokens.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np


@dataclass(frozen=True)
class MaskingConfig:
    """How positions are chosen for the masked-LM loss (Megatron's BERT settings by default)."""

    mask_prob: float = 0.15
    max_ngram: int = 3
    whole_word: bool = True
    use_longer_ngrams: bool = False
    use_geometric_distribution: bool = False

    def __post_init__(self):
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.mask_prob}")
        if self.max_ngram < 1:
            raise ValueError(f"--masking-max-ngram must be >= 1, got {self.max_ngram}")


def _word_candidates(tokens: List[int], special: Tuple[int, int], continuation: np.ndarray,
                     whole_word: bool) -> List[List[int]]:
    """Groups of positions that are masked together (see module doc, step 1)."""
    groups: List[List[int]] = []
    for pos, tok in enumerate(tokens):
        if tok in special:
            continue
        if continuation[tok] and whole_word and groups:
            groups[-1].append(pos)
        else:
            groups.append([pos])
    return groups


@functools.lru_cache(maxsize=None)
def _ngram_cdf(max_ngram: int, longer: bool) -> List[float]:
    """The CDF ``RandomState.choice`` builds from the n-gram probabilities (1/n normalised, optionally reversed)."""
    sizes = np.arange(max_ngram, dtype=np.int64) + 1
    probs = 1.0 / sizes
    probs = probs / probs.sum(keepdims=True)
    if longer:
        probs = probs[::-1]
    probs = probs / probs.sum(keepdims=True)
    cdf = probs.cumsum()
    cdf /= cdf[-1]
    return cdf.tolist()


def mask_tokens(tokens: List[int], target_length: int, rng: np.random.RandomState, cfg: MaskingConfig,
                cls_id: int, sep_id: int, mask_id: int, continuation: np.ndarray, lookup: np.ndarray
                ) -> Tuple[List[int], List[int], List[int]]:
    """(masked tokens, masked positions, original tokens at them); ``lookup`` is the replacement pool."""
    groups = _word_candidates(tokens, (cls_id, sep_id), continuation, cfg.whole_word)
    budget = min(cfg.mask_prob * target_length, max(1, int(round(len(tokens) * cfg.mask_prob))))
    cdf = _ngram_cdf(cfg.max_ngram, cfg.use_longer_ngrams)

    order = list(range(len(groups)))
    rng.shuffle(order)  # a list shuffles with the same draws as Megatron's list of n-gram lists

    masked = list(tokens)
    chosen: List[Tuple[int, int]] = []
    taken = set()
    for start in order:
        if len(chosen) >= budget:
            break
        if cfg.use_geometric_distribution:
            n = min(int(rng.geometric(0.2)), cfg.max_ngram)
        else:
            # RandomState.choice(1..N, p=probs) draws one random_sample() and searches the normalised CDF
            n = bisect.bisect_right(cdf, rng.random_sample()) + 1
        positions: List[int] = []
        while n > 0:
            positions = [p for group in groups[start:start + n] for p in group]
            n -= 1
            if budget >= len(chosen) + len(positions):
                break
        else:
            continue  # even the 1-gram overshoots the budget
        if any(p in taken for p in positions):
            continue
        for p in positions:
            taken.add(p)
            if rng.random() < 0.8:
                masked[p] = mask_id
            elif rng.random() >= 0.5:
                masked[p] = int(lookup[rng.randint(0, len(lookup))])
            chosen.append((p, tokens[p]))
    chosen.sort()
    return masked, [p for p, _ in chosen], [t for _, t in chosen]
