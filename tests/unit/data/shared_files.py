"""Files from the shared data folder beside the repository (``../shared/data``), which a fresh clone lacks.

``shared_file(...)`` returns the path, or skips the calling test with the reason when the file is absent.
"""

import os

import pytest

from tests.conftest import SHARED_DATA


def shared_file(*parts: str) -> str:
    path = os.path.join(SHARED_DATA, *parts)
    if not os.path.exists(path):
        pytest.skip(f"needs {os.path.join('shared', 'data', *parts)} beside the repository ({path} is absent)")
    return path
