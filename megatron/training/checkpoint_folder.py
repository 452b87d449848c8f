"""The folder of checkpoints (``--save`` / ``--load``): which iteration to load, and its housekeeping.

``choose_checkpoint`` (collective) verifies the files each rank is about to load and agrees on the iteration,
falling back to the newest intact one on request (``find_intact_checkpoint``); ``remove_stale_temp_files``,
``check_save_dir_writable`` and ``prune_checkpoints`` keep the folder clean and fail early.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Callable, List, Optional, Sequence

from megatron.core.checkpoint_io import (IN_FLIGHT, MANIFEST, CheckpointCorruptError, CheckpointIOError,
                                         describe_os_error, fsync_dir, hostname, iteration_dir, list_iterations,
                                         makedirs_durable, remove_quietly, verify_checkpoint)

# NAME.tmp.HOST.PID (checkpoint_io) or NAME.tmp.PID (older writers, host unknown)
TEMP_NAME = re.compile(r"^(?P<base>.+?)\.tmp\.(?:(?P<host>[^/]+)\.)?(?P<pid>\d+)$")


def find_intact_checkpoint(root: str, below: Optional[int] = None,
                           log: Optional[Callable[[str], None]] = None) -> Optional[int]:
    """The newest iteration (< ``below`` when given) whose folder has a manifest and matches it; else None.

    Every file is re-hashed, so this is meant for the fallback path, on one rank, with the answer broadcast.
    """
    for iteration in reversed(list_iterations(root)):
        if below is not None and iteration >= below:
            continue
        folder = iteration_dir(root, iteration)
        try:
            if verify_checkpoint(folder, iteration):
                return iteration
            if log:
                log(f"checkpoint iteration {iteration} in {folder} has no manifest (incomplete); skipped")
        except CheckpointIOError as exc:
            if log:
                log(f"{exc}; skipped")
    return None


def choose_checkpoint(root: str, iteration: int, relpaths: Sequence[str], fallback: bool = False,
                      log: Optional[Callable[[str], None]] = None, folder: Optional[str] = None) -> int:
    """Collective: verify this rank's ``relpaths`` of ``iteration``; return the iteration every rank should load.

    When any rank's file is missing or corrupt, every rank raises the same ``CheckpointCorruptError`` (the first
    failing rank's line), or with ``fallback`` loads the newest older checkpoint that is intact on every rank
    (found by global rank 0, ``log`` told why). A folder without manifest is loaded unverified (``log`` says so).
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    folder = folder or iteration_dir(root, iteration)
    error, verified = None, True
    try:
        verified = verify_checkpoint(folder, iteration, relpaths)
    except CheckpointCorruptError as exc:
        error = (str(exc), exc.path)
    outcomes = [(error, verified)]
    if distributed:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (error, verified))
    errors = [e for e, _ in outcomes if e is not None]
    if not errors:
        if log and rank0 and not all(v for _, v in outcomes):
            log(f"checkpoint iteration {iteration} in {folder} has no manifest: loaded without verification")
        return iteration
    message, path = errors[0]
    if not fallback:
        raise CheckpointCorruptError(message, path, iteration)
    box = [find_intact_checkpoint(root, below=iteration, log=log) if rank0 else None]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        raise CheckpointCorruptError(f"{message}; no earlier intact checkpoint under {root} to fall back to",
                                     path, iteration)
    if log and rank0:
        log(f"{message}; falling back to the intact checkpoint of iteration {box[0]}")
    return box[0]


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (one owned by another user counts as alive; a zombie,
    dead but not yet reaped by its parent, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def remove_stale_temp_files(root: str, quiescent: bool = False, max_depth: int = 3) -> List[str]:
    """Remove ``*.tmp.[HOST.]PID`` files under ``root`` left by savers that died; return their paths.

    A file of this host (or of an older writer that did not record its host) is stale when its process is not
    alive, or when it carries this process's id but this process is not writing it (a restarted container
    reuses ids). A file of another host is only removed when ``quiescent`` is True: the caller guarantees that
    no save of this run is in flight (all ranks passed the post-save barrier) and the run lock keeps other runs
    out.
    """
    removed = []
    me, here = os.getpid(), hostname()
    root = os.path.abspath(root)
    base_depth = root.rstrip(os.sep).count(os.sep)
    for folder, dirs, names in os.walk(root):
        if folder.count(os.sep) - base_depth >= max_depth:
            dirs[:] = []
        for name in names:
            m = TEMP_NAME.match(name)
            if not m:
                continue
            path = os.path.join(folder, name)
            pid, host = int(m.group("pid")), m.group("host")
            if host is None or host == here:
                stale = path not in IN_FLIGHT and (pid == me or not pid_alive(pid))
            else:
                stale = quiescent
            if stale:
                try:
                    os.remove(path)
                    removed.append(path)
                except FileNotFoundError:
                    pass
    return removed


def check_save_dir_writable(root: str, flag: str = "--save") -> int:
    """Create ``root`` if needed and write, fsync and remove a probe file in it; return the free bytes.

    Raises ``CheckpointIOError`` (``cannot write to the --save folder ROOT: read-only file system ...``) so a
    run fails before training rather than at its first save.
    """
    try:
        makedirs_durable(root)
    except CheckpointIOError as exc:
        raise CheckpointIOError(f"cannot create the {flag} folder {root}: {exc}") from exc
    probe = os.path.join(root, f".write_probe.tmp.{hostname()}.{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        remove_quietly(probe)
        raise CheckpointIOError(f"cannot write to the {flag} folder {root}: "
                                f"{describe_os_error(exc, probe)}") from exc
    remove_quietly(probe)
    return shutil.disk_usage(root).free


def prune_checkpoints(root: str, keep_last: int, tracker_iteration: int) -> List[str]:
    """Keep the checkpoint the tracker names and the ``keep_last - 1`` newest complete ones before it.

    Folders older than the tracker's that are not kept are removed (a failed, manifest-less save among them
    too); folders newer than the tracker's are never touched. A folder loses its manifest first, so a removal
    cut short leaves an incomplete folder, never one that looks complete. Returns the removed folders.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    older = [i for i in list_iterations(root) if i < tracker_iteration]
    complete = [i for i in older if os.path.isfile(os.path.join(iteration_dir(root, i), MANIFEST))]
    pool = complete if complete else older  # no manifests at all: checkpoints of an older writer
    keep = set(sorted(pool)[max(0, len(pool) - (keep_last - 1)):]) if keep_last > 1 else set()
    removed = []
    for iteration in older:
        if iteration in keep:
            continue
        folder = iteration_dir(root, iteration)
        manifest = os.path.join(folder, MANIFEST)
        if os.path.exists(manifest):
            os.remove(manifest)
            fsync_dir(folder)
        shutil.rmtree(folder)
        removed.append(folder)
    if removed:
        fsync_dir(root)
    return removed
