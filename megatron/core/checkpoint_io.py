"""The checkpoint folder on disk: the tracker, the iteration folders, durable writes and the manifest.

Every reader and writer of a ``--save``/``--load`` folder (the trainer, ``tools/checkpoint/convert.py``, the
inference loader) goes through this module, and every error it raises is a ``CheckpointIOError`` (one line
naming the file). The folder holds ``latest_checkpointed_iteration.txt`` (the tracker: an iteration number, or
``release``) and one ``iter_NNNNNNN`` (or ``release``) folder per checkpoint (Megatron-LM's layout).

A checkpoint folder (``ROOT/iter_0000100``) is written in this order, and each step only starts when the
previous one is on disk:

1. every writer saves its files with ``save_file`` / ``save_torch``: temporary name ``NAME.tmp.HOST.PID`` in the
   same folder, flush + fsync, rename, fsync of the folder; the SHA-256 of the bytes is computed on the
   writer's thread while they are written and returned as a ``FileRecord``;
2. all records reach one rank (``gather_records``), which writes ``iter_.../manifest.json`` (the same way):
   a checkpoint folder without a manifest is incomplete;
3. only then does the tracker file move (``write_text_durable``).

At load, ``verify_checkpoint`` re-hashes the files a rank is about to read and raises ``CheckpointCorruptError``
naming the file and the iteration on a missing, truncated or altered file; ``find_intact_checkpoint`` walks back
to the newest checkpoint whose files all match (both in ``checkpoint_folder``). OS errors while writing (disk full, permission, read-only file
system) become one ``CheckpointIOError`` line with the path; the partial temporary file is removed and nothing
already on disk is touched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
from dataclasses import dataclass
import re
from typing import BinaryIO, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# Stored in every file this framework saves into a checkpoint folder: a folder whose file carries it was written
# with a manifest, so a missing manifest there means damage, not an older or foreign writer.
MANIFEST_KEY = "manifest"
ITER_DIR = re.compile(r"^iter_(\d{7,})$")
HASH_ALGORITHM = "sha256"  # hardware-accelerated in OpenSSL on current x86/ARM CPUs; see docs/reliability.md

_READ_CHUNK = 8 << 20
IN_FLIGHT: set = set()  # temporary paths this process is writing right now (kept by cleanup)


class CheckpointIOError(RuntimeError):
    """A checkpoint could not be written or read; the message is one line naming the path."""


class CheckpointCorruptError(CheckpointIOError):
    """A checkpoint file is missing or differs from the checksum recorded when it was saved."""

    def __init__(self, message: str, path: str, iteration: Optional[int]):
        super().__init__(message)
        self.path = path
        self.iteration = iteration


@dataclass(frozen=True)
class FileRecord:
    """One written file: its path relative to the checkpoint folder, its size and its digest."""

    relpath: str
    size: int
    digest: str


# ---- errors -------------------------------------------------------------------------------------------------
_REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "read-only file system", errno.EIO: "input/output error"}


def describe_os_error(exc: OSError, path: str, action: str = "writing") -> str:
    """``no space left on device while writing PATH`` and the like: one line, the reason first."""
    reason = _REASONS.get(exc.errno, exc.strerror or type(exc).__name__)
    return f"{reason} while {action} {path}"


# ---- durable writes -----------------------------------------------------------------------------------------
def hostname() -> str:
    return socket.gethostname() or "localhost"


def temp_path(path: str) -> str:
    return f"{path}.tmp.{hostname()}.{os.getpid()}"


def fsync_dir(path: str) -> None:
    """Make a rename or creation inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems refuse fsync on a directory; the data fsync still holds
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """``os.makedirs`` that fsyncs the parent of every folder it creates."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CheckpointIOError(describe_os_error(exc, folder, "creating")) from exc
        fsync_dir(os.path.dirname(folder))


class _HashingWriter:
    """A write-only file object that hashes and counts every byte on its way to the real file."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.hash = hashlib.new(HASH_ALGORITHM)
        self.size = 0
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._f.write(view)
        except OSError as exc:  # kept: some serializers wrap it in another exception type
            self.error = exc
            raise
        self.hash.update(view)
        self.size += view.nbytes
        return written if written is not None else view.nbytes

    def flush(self) -> None:
        self._f.flush()

    def writable(self) -> bool:
        return True


def save_file(ckpt_dir: str, relpath: str, write: Callable[[BinaryIO], None]) -> FileRecord:
    """Write ``ckpt_dir/relpath`` durably through ``write(file)``; return its ``FileRecord``.

    ``write`` receives a write-only, non-seekable file object (``torch.save`` accepts it). On any failure the
    temporary file is removed and an existing file under the final name stays as it was; an ``OSError``
    becomes one ``CheckpointIOError`` line (``no space left on device while writing PATH``).
    """
    path = os.path.join(ckpt_dir, relpath)
    makedirs_durable(os.path.dirname(path))
    tmp = temp_path(path)
    key = os.path.abspath(tmp)  # cleanup compares absolute paths
    IN_FLIGHT.add(key)
    writer = None
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
    except BaseException as exc:
        remove_quietly(tmp)
        cause = exc if isinstance(exc, OSError) else (writer.error if writer is not None else None)
        if cause is not None and not isinstance(exc, CheckpointIOError):
            raise CheckpointIOError(describe_os_error(cause, path)) from exc
        raise
    finally:
        IN_FLIGHT.discard(key)
    return FileRecord(relpath.replace(os.sep, "/"), writer.size, writer.hash.hexdigest())


def save_torch(obj, ckpt_dir: str, relpath: str) -> FileRecord:
    """``torch.save(obj)`` into ``ckpt_dir/relpath`` through ``save_file``."""
    import torch

    return save_file(ckpt_dir, relpath, lambda f: torch.save(obj, f))


def write_text_durable(path: str, text: str) -> None:
    """Replace a small text file (the tracker) atomically and durably."""
    folder = os.path.dirname(path) or "."
    save_file(folder, os.path.basename(path), lambda f: f.write(text.encode()))


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# ---- the tracker and the iteration folders -----------------------------------------------------------------
def iteration_dir(root: str, iteration: int, release: bool = False) -> str:
    """``ROOT/iter_NNNNNNN`` (``ROOT/release`` for a release checkpoint)."""
    return os.path.join(root, RELEASE if release else f"iter_{iteration:07d}")


def list_iterations(root: str) -> List[int]:
    """Iterations of the ``iter_NNNNNNN`` folders under ``root``, ascending."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = (ITER_DIR.match(n) for n in names)
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def has_tracker(root: Optional[str]) -> bool:
    return bool(root) and os.path.isfile(os.path.join(root, TRACKER))


def read_tracker(root: str, flag: str = "--load") -> Tuple[int, str]:
    """``(iteration, iteration folder)`` the tracker of ``root`` names (``release``: ``(0, ROOT/release)``).

    Raises ``CheckpointIOError`` when ``root`` is not a folder, has no tracker, or the tracker holds anything
    but ``release`` or a non-negative iteration number (written by hand, damaged).
    """
    if not os.path.isdir(root):
        raise CheckpointIOError(f"{flag} folder {root} does not exist")
    tracker = os.path.join(root, TRACKER)
    try:
        with open(tracker, "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        raise CheckpointIOError(f"no checkpoint to load: {tracker} does not exist") from None
    except OSError as exc:
        raise CheckpointIOError(describe_os_error(exc, tracker, "reading")) from exc
    text = raw.decode("utf-8", "replace").strip()
    if text == RELEASE:
        return 0, iteration_dir(root, 0, release=True)
    if not (text.isascii() and text.isdigit()):
        raise CheckpointIOError(f"corrupt tracker file {tracker}: expected a non-negative iteration number or "
                                f"'{RELEASE}', found {text[:40]!r}")
    return int(text), iteration_dir(root, int(text))


def write_tracker(root: str, iteration: int, release: bool = False) -> None:
    """Point the tracker at ``iteration`` (or ``release``), atomically and durably; call it only once every
    file of that checkpoint, and its manifest, is on disk."""
    if iteration < 0:
        raise CheckpointIOError(f"cannot record iteration {iteration} in {os.path.join(root, TRACKER)}")
    write_text_durable(os.path.join(root, TRACKER), RELEASE if release else str(int(iteration)))


# ---- manifest -----------------------------------------------------------------------------------------------
def gather_records(records: Sequence[FileRecord], error: Optional[BaseException] = None,
                   group=None) -> List[FileRecord]:
    """Collective: every rank's records on every rank, or the first rank's ``error`` raised on every rank.

    Pass the ``CheckpointIOError`` a writer caught, so that no rank waits for a file that will never come.
    """
    import torch.distributed as dist

    mine = ([(r.relpath, r.size, r.digest) for r in records], None if error is None else str(error))
    parts = [mine]
    if dist.is_available() and dist.is_initialized():
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
    failed = [msg for _, msg in parts if msg is not None]
    if failed:
        raise CheckpointIOError(failed[0]) from error
    return [FileRecord(*t) for part, _ in parts for t in part]


def write_manifest(ckpt_dir: str, iteration: int, records: Iterable[FileRecord]) -> str:
    """Write ``ckpt_dir/manifest.json`` (after every file it lists is on disk); it marks the folder complete."""
    files: Dict[str, dict] = {}
    for r in records:
        if r.relpath in files and files[r.relpath]["digest"] != r.digest:
            raise CheckpointIOError(f"two writers wrote different {os.path.join(ckpt_dir, r.relpath)}")
        files[r.relpath] = {"size": r.size, "digest": r.digest}
    body = {"format": MANIFEST_FORMAT, "iteration": int(iteration), "algorithm": HASH_ALGORITHM,
            "files": dict(sorted(files.items()))}
    save_file(ckpt_dir, MANIFEST, lambda f: f.write(json.dumps(body, indent=1).encode()))
    return os.path.join(ckpt_dir, MANIFEST)


def write_folder_manifest(ckpt_dir: str, iteration: int) -> str:
    """Hash every file already in ``ckpt_dir`` and write its manifest (for writers that did not hash while
    writing, such as the converter: one more read of each file)."""
    records = []
    for folder, _, names in os.walk(ckpt_dir):
        for name in sorted(names):
            path = os.path.join(folder, name)
            if name == MANIFEST or ".tmp." in name:
                continue
            rel = os.path.relpath(path, ckpt_dir)
            records.append(FileRecord(rel.replace(os.sep, "/"), os.path.getsize(path), file_digest(path)))
    return write_manifest(ckpt_dir, iteration, records)


def invalidate_manifest(ckpt_dir: str) -> bool:
    """Remove ``ckpt_dir``'s manifest before its files are written again (a re-save of the same iteration), so
    a save cut short leaves an incomplete folder, never one whose manifest lists older bytes."""
    try:
        os.remove(os.path.join(ckpt_dir, MANIFEST))
    except FileNotFoundError:
        return False
    fsync_dir(ckpt_dir)
    return True


def read_manifest(ckpt_dir: str, iteration: Optional[int] = None) -> Optional[dict]:
    """The manifest of ``ckpt_dir``, or None when it has none (incomplete, or saved without manifests)."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read().decode())
        files, algorithm = body["files"], body["algorithm"]
        hashlib.new(algorithm)
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
        for rel, entry in files.items():
            if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                    and isinstance(entry.get("digest"), str)):
                raise TypeError(f"the entry of {rel!r} is {json.dumps(entry)[:80]}, not "
                                "{\"size\": bytes, \"digest\": hex string}")
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"checkpoint iteration {iteration}: manifest {path} is unreadable "
                                     f"({type(exc).__name__}: {exc})", path, iteration) from exc
    except OSError as exc:
        raise CheckpointIOError(describe_os_error(exc, path, "reading")) from exc
    return body


def written_with_manifest(path: str) -> bool:
    """Whether ``path`` is a file this framework saved (it carries ``MANIFEST_KEY``), which means that its
    folder had a manifest. Reads the pickle only (tensors are memory-mapped, not read); False for a file that
    is absent, unreadable or another writer's."""
    import torch

    if not os.path.isfile(path):
        return False
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # damaged or foreign: the loader itself names the file
        return False
    return isinstance(state, dict) and state.get(MANIFEST_KEY) == MANIFEST_FORMAT


def file_digest(path: str, algorithm: str = HASH_ALGORITHM) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while True:
            block = f.read(_READ_CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)


def verify_checkpoint(ckpt_dir: str, iteration: Optional[int], relpaths: Optional[Sequence[str]] = None) -> bool:
    """Check ``relpaths`` (default: every file of the manifest) against the manifest.

    Returns False when the folder has no manifest (nothing to check against: an older checkpoint); True when
    every file matches. Raises ``CheckpointCorruptError`` naming the first missing or differing file.
    """
    where = f"checkpoint iteration {iteration}"
    if not os.path.isdir(ckpt_dir):
        raise CheckpointCorruptError(f"{where}: its folder {ckpt_dir} does not exist", ckpt_dir, iteration)
    manifest = read_manifest(ckpt_dir, iteration)
    if manifest is None:
        for rel in relpaths or ():
            path = os.path.join(ckpt_dir, rel)
            if written_with_manifest(path):
                raise CheckpointCorruptError(
                    f"{where}: {os.path.join(ckpt_dir, MANIFEST)} is missing, but {path} was saved with one (the "
                    "manifest was deleted, or the folder was damaged); its files cannot be verified", path,
                    iteration)
        return False
    if iteration is not None and manifest.get("iteration") != iteration:
        path = os.path.join(ckpt_dir, MANIFEST)
        raise CheckpointCorruptError(f"{where}: manifest {path} belongs to iteration {manifest.get('iteration')}",
                                     path, iteration)
    files = manifest["files"]
    for rel in (files if relpaths is None else [r.replace(os.sep, "/") for r in relpaths]):
        path = os.path.join(ckpt_dir, rel)
        if rel not in files:
            raise CheckpointCorruptError(f"{where}: {path} is not listed in the manifest "
                                         f"{os.path.join(ckpt_dir, MANIFEST)}", path, iteration)
        want = files[rel]
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where}: file {path} is missing", path, iteration) from None
        if size != want["size"]:
            raise CheckpointCorruptError(f"{where}: file {path} has {size} bytes, {want['size']} were saved "
                                         "(truncated or overwritten)", path, iteration)
        try:
            digest = file_digest(path, manifest["algorithm"])
        except OSError as exc:
            raise CheckpointIOError(describe_os_error(exc, path, "reading")) from exc
        if digest != want["digest"]:
            raise CheckpointCorruptError(f"{where}: file {path} is corrupt (its {manifest['algorithm']} differs "
                                         "from the one recorded when it was saved)", path, iteration)
    return True
