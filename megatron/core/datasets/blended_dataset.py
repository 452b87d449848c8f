"""BlendedDataset: samples drawn from several datasets in fixed proportions (``--data-path w1 p1 w2 p2``).

Sample ``t`` comes from the dataset whose share so far lags its weight the most (see ``blending.py``),
and is that dataset's next sample; so after any prefix of ``t`` samples each dataset has supplied
``weight * t`` samples up to rounding. Items are the contributing dataset's items plus ``dataset_id``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from megatron.core.datasets.blending import build_blending_indices, build_exhaustive_blending_indices
from megatron.core.datasets.index_cache import IndexCache, description_hash

_INDEX_KEYS = ("dataset_index", "dataset_sample_index")


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum (as float64, like Megatron)."""
    w = np.array(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


class BlendedDataset:
    """Blend ``datasets`` by ``weights`` into ``size`` samples.

    With ``size`` None the weights must be the datasets' sample counts and every sample of every dataset
    is used exactly once (Megatron's exhaustive blend). Raises ``ValueError`` when the blend would ask a
    dataset for more samples than it has.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: Optional[int],
                 cache_dir: Optional[str] = None, build: bool = True, split: str = "train"):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if not datasets or len(datasets) >= 32767:
            raise ValueError(f"a blend needs between 1 and 32766 datasets, got {len(datasets)}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        self.datasets = list(datasets)
        self.split = split
        self.size = size
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.description = {
            "class": "BlendedDataset",
            "datasets": [getattr(d, "hash", repr(d)) for d in self.datasets],
            "weights": self.weights,
            "size": size,
            "split": split,
        }
        self.hash = description_hash(self.description)
        self.dataset_index, self.dataset_sample_index = self._load_or_build(cache_dir, build)

    def _load_or_build(self, cache_dir: Optional[str], build: bool):
        cache = IndexCache(cache_dir, self.description, "BlendedDataset", self.split, _INDEX_KEYS)
        arrays = cache.load_or_build(self._build_indices, may_save=build)
        return arrays["dataset_index"], arrays["dataset_sample_index"]

    def _build_indices(self):
        if self.size is not None:
            ds, ds_sample = build_blending_indices(self.weights, self.size)
        else:
            ds, ds_sample = build_exhaustive_blending_indices(self.weights)
        counts = np.bincount(ds, minlength=len(self.datasets))
        for i, (n, d) in enumerate(zip(counts, self.datasets)):
            if n > len(d):
                raise ValueError(
                    f"the {self.split} blend asks dataset {i} for {n} samples but it has {len(d)}; "
                    f"request more samples from it (Megatron builds a 0.5% surplus per dataset)")
        return {"dataset_index": ds, "dataset_sample_index": ds_sample}

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx):
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} blended samples ({self.split})")
        d = int(self.dataset_index[idx])
        item = dict(self.datasets[d][int(self.dataset_sample_index[idx])])
        item["dataset_id"] = d
        return item
