"""``--mock-data`` for BERT: masked-LM samples of random tokens, shaped like ``BERTMaskedDataset``'s.

Sample ``i`` of a split is ``[CLS] A [SEP] B [SEP]`` (``[CLS] A [SEP]`` without the binary head) with segments
of uniform random non-special ids filling the sequence, ``B`` and ``A`` swapped half of the time (``is_random``),
masked by the real dataset's ``mask_tokens`` with the run's masking settings. It depends only on the seed, the
split and ``i``, so every rank and every resume sees the same sample. For benchmarks and smoke tests: random
tokens carry nothing to learn.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from megatron.core.datasets.bert_dataset import BertDatasetConfig
from megatron.core.datasets.masking import mask_tokens

_SPLITS = {"train": 0, "valid": 1, "test": 2}


class MockBertDataset:
    def __init__(self, num_samples: int, config: BertDatasetConfig, split: str):
        self.num_samples, self.config = int(num_samples), config
        self.seed = config.seed * 3 + _SPLITS[split]
        v = config.vocab
        special = {v.cls, v.sep, v.mask, v.pad}
        self.pool = np.array([t for t in v.lookup.tolist() if t not in special], dtype=np.int64)
        if self.pool.size == 0:
            raise ValueError("--mock-data needs a vocabulary with ordinary tokens besides [CLS] [SEP] [MASK] [PAD]")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx) -> Dict[str, object]:
        idx = int(idx)
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock sample {idx} out of range for {self.num_samples} samples")
        cfg, v = self.config, self.config.vocab
        rng = np.random.RandomState(np.random.SeedSequence([self.seed, idx]).generate_state(1)[0])
        n = cfg.seq_length
        body = self.pool[rng.randint(0, self.pool.size, size=n - 3)].tolist()
        is_random = bool(cfg.binary_head and rng.random_sample() < 0.5)
        if cfg.binary_head:
            cut = int(rng.randint(1, len(body)))
            a, b = body[:cut], body[cut:]
            if is_random:
                a, b = b, a
            tokens, types = [v.cls, *a, v.sep, *b, v.sep], [0] * (len(a) + 2) + [1] * (len(b) + 1)
        else:
            tokens, types = [v.cls, *body, v.sep], [0] * (len(body) + 2)
        tokens, positions, originals = mask_tokens(tokens, len(tokens), rng, cfg.masking, v.cls, v.sep, v.mask,
                                                   v.continuation, v.lookup)
        text = np.zeros(n, dtype=np.int64)
        text[:len(tokens)] = tokens
        token_types = np.zeros(n, dtype=np.int64)
        token_types[:len(types)] = types
        padding_mask = np.zeros(n, dtype=np.int64)
        padding_mask[:len(tokens)] = 1
        labels = np.full(n, -1, dtype=np.int64)
        labels[positions] = originals
        loss_mask = np.zeros(n, dtype=np.int64)
        loss_mask[positions] = 1
        return {"text": text, "types": token_types, "labels": labels, "is_random": int(is_random),
                "padding_mask": padding_mask, "loss_mask": loss_mask, "truncated": 0}


def mock_bert_datasets(num_samples, config: BertDatasetConfig):
    """(train, valid, test) mock BERT datasets; a split asked for 0 samples is None."""
    return tuple(MockBertDataset(n, config, split) if n > 0 else None
                 for n, split in zip(num_samples, ("train", "valid", "test")))
