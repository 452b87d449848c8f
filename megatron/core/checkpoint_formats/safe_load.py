"""Unpickle Megatron-LM checkpoint files through an explicit allowlist, never running code from them.

Megatron-LM's legacy ``model_optim_rng.pt`` pickles an ``argparse.Namespace``, NumPy arrays and dtypes (the NumPy RNG
state), Megatron enums (``ModelType``, ``AttnBackend``) and torch dtypes. ``torch.load(weights_only=True)`` refuses
all of these. Here each one is mapped to an inert stand-in (Megatron's classes are never imported): a namespace
becomes :class:`PickledNamespace` (attributes only), an enum member becomes :class:`PickledEnum` (class name and
value), NumPy arrays and dtypes are rebuilt by NumPy's own data-only constructors. A file that needs any other
global is refused before unpickling, with one line naming the global.
"""

from __future__ import annotations

import argparse
import io
import pickle
import re
from typing import Any, Dict, Optional

import numpy as np
import torch

from megatron.core.checkpoint_io import CheckpointIOError


class CheckpointFormatError(CheckpointIOError, ValueError):
    """A checkpoint that cannot be read or converted; the message names the file or flag and the reason."""


class PickledNamespace:
    """Stand-in for ``argparse.Namespace``: holds the unpickled attributes, runs nothing."""

    def __repr__(self) -> str:
        return f"PickledNamespace({sorted(vars(self))})"


class PickledEnum:
    """Stand-in for a Megatron enum member: the class's name and the member's value."""

    enum_name = "Enum"
    members: Dict[Any, str] = {}

    def __init__(self, value):
        self.value = value

    def __str__(self) -> str:
        member = self.members.get(self.value)
        return f"{self.enum_name}.{member}" if member is not None else f"{self.enum_name}({self.value!r})"

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, PickledEnum) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


def _enum(name: str, members: Dict[Any, str]) -> type:
    return type(name, (PickledEnum,), {"enum_name": name, "members": members})


# value -> member name, as Megatron-Core defines them (megatron/core/enums.py, megatron/core/transformer/enums.py)
_MEGATRON_ENUMS = {
    "megatron.core.enums.ModelType": _enum("ModelType", {1: "encoder_or_decoder", 2: "encoder_and_decoder"}),
    "megatron.core.transformer.enums.AttnBackend": _enum(
        "AttnBackend", {1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto"}),
    "megatron.core.transformer.enums.AttnMaskType": _enum(
        "AttnMaskType", {1: "padding", 2: "causal", 3: "no_mask", 4: "padding_causal", 5: "arbitrary"}),
}


def _numpy_globals() -> Dict[str, Any]:
    out = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy's data-only array constructor
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[f"{module}._reconstruct"] = reconstruct
    dtypes = getattr(np, "dtypes", None)  # NumPy >= 1.25 pickles a dtype through its class
    if dtypes is not None:
        for name in dir(dtypes):
            cls = getattr(dtypes, name)
            if isinstance(cls, type) and issubclass(cls, np.dtype):
                out[f"numpy.dtypes.{name}"] = cls
    return out


def allowed_globals() -> Dict[str, Any]:
    """Global name in the pickle -> the inert object that stands in for it."""
    out = {"argparse.Namespace": PickledNamespace}
    out.update(_MEGATRON_ENUMS)
    out.update(_numpy_globals())
    return out


def load_megatron_file(path: str, data: Optional[io.BytesIO] = None) -> Any:
    """``torch.load`` of a Megatron-LM checkpoint file with the allowlist; raises :class:`CheckpointFormatError`.

    ``data``: the file's bytes when they are not a file of their own (a ``torch_dist`` checkpoint's pickled
    objects); ``path`` then names them in messages."""
    allowed = allowed_globals()
    source = path if data is None else data
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception as exc:  # not a zip file, truncated, ...
        raise CheckpointFormatError(describe_load_error(path, exc)) from exc
    refused = sorted(set(needed) - set(allowed))
    if refused:
        raise CheckpointFormatError(
            f"refusing to load {path}: it needs the unpickling global {refused[0]}, which is not on the allowlist "
            f"of a Megatron-LM checkpoint" + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""))
    # every stand-in is registered, not only the named ones: an array's dtype instance (e.g. UInt32DType) is built
    # from ``numpy.dtype`` and must itself be allowed
    stand_ins = [(obj, name) for name, obj in allowed.items()]
    if data is not None:
        data.seek(0)
    try:
        with torch.serialization.safe_globals(stand_ins):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointFormatError(f"cannot read checkpoint {path}: {type(exc).__name__}: {_one_line(exc)}") from exc


_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colour codes torch puts in its messages
_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


def _one_line(exc: Exception) -> str:
    """The informative part of torch's multi-line weights-only error: the refused global, or the first sentence."""
    text = _ESCAPES.sub("", str(exc))
    found = _GLOBAL.search(text)
    if found:
        return f"it needs the unpickling global {found.group(1)}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0].split(". ")[0].rstrip(".") if lines else type(exc).__name__


def describe_load_error(path: str, exc: Exception) -> str:
    """One line for a file that ``torch.load(weights_only=True)`` refused: what the file is not, without torch's
    advice to load it unsafely."""
    detail = _one_line(exc)
    if isinstance(exc, pickle.UnpicklingError):
        return (f"{path} is not a checkpoint of this framework (it needs unpickling beyond tensors and plain types: "
                f"{detail.removeprefix('it needs the unpickling global ')})")
    if "zip archive" in detail or "central directory" in detail:
        return f"{path} is not a complete torch file (truncated or of another kind: {detail})"
    return f"cannot read {path}: {type(exc).__name__}: {detail}"


def to_plain(obj: Any) -> Any:
    """Stand-ins to plain Python: namespaces to dicts, enums and torch dtypes to their names (recursively).

    Tensors and NumPy arrays are left as they are."""
    if isinstance(obj, (PickledNamespace, argparse.Namespace)):
        return {k: to_plain(v) for k, v in vars(obj).items()}
    if isinstance(obj, PickledEnum):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj)
    return obj
