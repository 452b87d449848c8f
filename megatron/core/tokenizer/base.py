"""What several tokenizer types share: the check of the files they are built from, and a vocabulary held as a
dict."""

from __future__ import annotations

import os
from typing import Dict, Optional


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


class DictVocabulary:
    """``vocab_size`` and ``vocab`` of a tokenizer whose vocabulary is the dict ``self._vocab`` (token -> id)."""

    _vocab: Dict[str, int]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict:
        return dict(self._vocab)
