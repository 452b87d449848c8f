"""Checks of the files a tokenizer is built from, shared by every tokenizer type."""

from __future__ import annotations

import os
from typing import Optional


def require_file(path: Optional[str], flag: str, kind: str) -> None:
    """A ``ValueError`` naming ``flag`` and ``path`` unless ``path`` is a readable file (``kind``: the tokenizer
    type that needs it)."""
    if not path:
        raise ValueError(f"{kind} needs {flag}")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r}: no such file (needed by {kind})")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        raise ValueError(f"{flag} {path!r}: cannot be read ({err.strerror or err})") from None
