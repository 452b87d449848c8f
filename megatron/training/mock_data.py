"""``--mock-data``: synthetic token samples shaped like the GPT dataset's, for benchmarks and smoke tests."""

from __future__ import annotations

from typing import Dict

import numpy as np


class MockGPTDataset:
    """``num_samples`` items ``{"text": int64[seq_length + 1]}`` of uniform random ids in ``[0, vocab_size)``.

    Item ``i`` depends only on ``(seed, i)``, so every rank and every resume sees the same sample; each split
    gets its own seed offset so validation never repeats training samples.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: str):
        if vocab_size < 1:
            raise ValueError(f"--mock-data needs a tokenizer with a vocabulary, got size {vocab_size}")
        self.num_samples, self.seq_length, self.vocab_size = int(num_samples), seq_length, vocab_size
        self.seed = seed * 3 + {"train": 0, "valid": 1, "test": 2}[split]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx) -> Dict[str, np.ndarray]:
        idx = int(idx)
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock sample {idx} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, idx])
        return {"text": rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)}


def mock_gpt_datasets(num_samples, seq_length: int, vocab_size: int, seed: int):
    """(train, valid, test) mock datasets; a split asked for 0 samples is None."""
    return tuple(MockGPTDataset(n, seq_length, vocab_size, seed, split) if n > 0 else None
                 for n, split in zip(num_samples, ("train", "valid", "test")))
