"""Cached index arrays of the datasets: saved once under a cache folder, memory-mapped afterwards.

A dataset describes everything that determines its indices in a small JSON-able dict; the first 32 hex
digits of its sha256 name the files ``{hash}-{Class}-{split}-{key}.npy`` (plus a ``-description.txt``
holding the dict for people). Files are written under temporary names and renamed, so a reader never
sees half a file; a missing file means a cache miss.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional, Sequence

import numpy as np


def description_hash(description: dict) -> str:
    """32 hex digits naming the indices of ``description``."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


class IndexCache:
    """The cached arrays ``keys`` of one dataset (``cache_dir`` None: nothing is cached)."""

    def __init__(self, cache_dir: Optional[str], description: dict, class_name: str, split: str,
                 keys: Sequence[str]):
        self.cache_dir = cache_dir
        self.description = description
        self.hash = description_hash(description)
        self.base = f"{self.hash}-{class_name}-{split}"
        self.keys = tuple(keys)

    def paths(self) -> Dict[str, str]:
        if self.cache_dir is None:
            return {}
        return {k: os.path.join(self.cache_dir, f"{self.base}-{k}.npy") for k in self.keys}

    def load(self) -> Optional[Dict[str, np.ndarray]]:
        """The arrays memory-mapped read-only, or None when caching is off or any file is missing."""
        paths = self.paths()
        if not paths or not all(os.path.isfile(p) for p in paths.values()):
            return None
        arrays = {}
        for key, path in paths.items():
            try:
                arrays[key] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                why = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise ValueError(f"cached index file {path} is damaged ({why}); delete it and it is built "
                                 "again") from exc
        return arrays

    def save(self, arrays: Dict[str, np.ndarray]) -> None:
        """Write every array (temporary name, then rename) and the description; no-op without a cache folder."""
        if self.cache_dir is None:
            return
        os.makedirs(self.cache_dir, exist_ok=True)
        for key, path in self.paths().items():
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                np.save(f, arrays[key], allow_pickle=False)
            os.replace(tmp, path)
        tmp = os.path.join(self.cache_dir, f"{self.base}-description.txt.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.description, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(self.cache_dir, f"{self.base}-description.txt"))

    def load_or_build(self, build_fn, may_save: bool) -> Dict[str, np.ndarray]:
        """Cached arrays when present; otherwise ``build_fn()`` (a dict of arrays), saved when ``may_save``."""
        cached = self.load()
        if cached is not None:
            return cached
        arrays = build_fn()
        if may_save:
            self.save(arrays)
        return arrays
