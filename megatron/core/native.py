"""Small C loops compiled on first use into the user's cache, with NumPy fallbacks where they are called.

Several hot loops (blending indices, GPT-2 piece hashing) are a few dozen lines of C. Rather than a build step,
``load_c_library`` compiles such a source once per user and source version with the system C compiler, loads it
with ctypes, and returns ``None`` when that is impossible (no compiler, read-only home) or disabled with
``MEGATRON_NO_C_HELPERS=1``; callers then run their NumPy path, which gives the same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from typing import Optional, Sequence


def cache_dir() -> str:
    """``$XDG_CACHE_HOME/megatron-lite`` (default ``~/.cache/megatron-lite``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron-lite")


def c_helpers_disabled() -> bool:
    return os.environ.get("MEGATRON_NO_C_HELPERS", "0") not in ("", "0")


def load_c_library(name: str, source: str, extra_flags: Sequence[str] = ()) -> Optional[ctypes.CDLL]:
    """Compile ``source`` (once; keyed by its hash) into ``cache_dir()/name_<hash>.so`` and load it."""
    if c_helpers_disabled():
        return None
    tag = hashlib.sha256(source.encode()).hexdigest()[:16]
    try:
        folder = cache_dir()
        os.makedirs(folder, exist_ok=True)
        so = os.path.join(folder, f"{name}_{tag}.so")
        if not os.path.exists(so):
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src, out = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.so")
                with open(src, "w") as f:
                    f.write(source)
                cmd = [os.environ.get("CC", "cc"), "-O2", *extra_flags, "-shared", "-fPIC", src, "-o", out]
                subprocess.run(cmd, check=True, capture_output=True, timeout=60)
                os.replace(out, so)  # atomic: concurrent builders never see half a library
        return ctypes.CDLL(so)
    except (OSError, subprocess.SubprocessError):
        return None
