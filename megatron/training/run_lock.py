"""An advisory lock on a run's ``--save`` folder, so two runs never write the same checkpoints.

The lock is the file ``SAVE/run.lock`` holding one JSON record (host, pid, start time, command line). The
owner keeps an exclusive ``fcntl.flock`` on it for its whole life and touches it every ``heartbeat_s`` seconds.
A second run finds the flock taken (or, where flock does not reach across hosts, a fresh record) and stops
with one line naming the first run. A record left behind by a run that died is taken over with a note:

* same host: its process is gone, or it is alive but does not hold the flock (its id was reused), or it
  carries this process's own id (a restarted container reuses ids);
* another host: its heartbeat is older than ``stale_after_s`` seconds (the host's pids cannot be checked).

Only one process per folder takes the lock (global rank 0: ``acquire_for_job``); it is released at exit.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from megatron.training.checkpoint_folder import pid_alive
from megatron.core.checkpoint_io import hostname

LOCK_NAME = "run.lock"
_HELD: set = set()  # the locks this process holds


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker): close the inherited lock files without unlocking them, so the
    lock stays the parent's alone and ends with the parent, whatever the child does."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class RunLockError(RuntimeError):
    """The folder is locked by another live run (one line naming it), or the lock cannot be taken."""


@dataclass(frozen=True)
class LockRecord:
    host: str
    pid: int
    started: float
    command: str = ""

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"host {self.host}, pid {self.pid}, since {since}"


def _read_record(fd: int) -> Optional[LockRecord]:
    raw = os.pread(fd, 1 << 16, 0)
    try:
        body = json.loads(raw.decode())
        return LockRecord(str(body["host"]), int(body["pid"]), float(body["started"]), str(body.get("command", "")))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None  # empty (its writer died between creating and filling it) or not ours


class RunLock:
    """``with RunLock(folder):`` or ``acquire()`` / ``release()``; ``note`` says whether a stale lock was taken."""

    def __init__(self, folder: str, heartbeat_s: float = 30.0, stale_after_s: float = 300.0):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.note: Optional[str] = None
        self.record: Optional[LockRecord] = None
        self._fd: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- taking it --------------------------------------------------------------------------------------
    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as exc:
            raise RunLockError(f"cannot create the folder {self.folder} to lock it: {exc.strerror}") from exc
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise RunLockError(f"cannot open the lock file {self.path}: {exc.strerror}") from exc
            locked = self._try_flock(fd)  # True, False (held by another), None (flock not supported here)
            if locked is False:
                other = _read_record(fd)
                if other is not None and other.host == hostname() and not pid_alive(other.pid):
                    locked = self._wait_for_orphans(fd)
            if locked is False:
                os.close(fd)
                raise RunLockError(self._busy(other, orphaned=other is not None and other.host == hostname()
                                              and not pid_alive(other.pid)))
            if self._same_file(fd):
                break
            os.close(fd)  # the previous owner removed the file between our open and our flock: again
        else:
            raise RunLockError(f"cannot lock {self.path}: the file keeps being replaced")
        try:
            other = _read_record(fd)
            me = LockRecord(hostname(), os.getpid(), time.time(), " ".join(sys.argv)[:500])
            if other is not None:
                why = self._stale_reason(other, fd, locked)
                if why is None:
                    raise RunLockError(self._busy(other))
                self.note = f"took over the stale lock {self.path} of {other.describe()}: {why}"
            body = json.dumps({"host": me.host, "pid": me.pid, "started": me.started, "command": me.command})
            os.ftruncate(fd, 0)
            os.pwrite(fd, body.encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.record = fd, me
        _HELD.add(self)
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.release)
        return self

    @staticmethod
    def _try_flock(fd: int) -> Optional[bool]:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return None
            raise

    def _wait_for_orphans(self, fd: int, wait_s: float = 10.0) -> bool:
        """The recorded owner is dead but the flock is held: by children it started (they share its open file),
        which die with it (DataLoader workers are asked to) a moment later. Wait up to ``wait_s`` for them."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if self._try_flock(fd):
                return True
        return False

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _stale_reason(self, other: LockRecord, fd: int, locked: Optional[bool]) -> Optional[str]:
        """Why ``other``'s lock is stale, or None when its run must be presumed alive."""
        if other.host == hostname():
            if other.pid == os.getpid():
                return "it carries this process's id, so its own process has ended"
            if not pid_alive(other.pid):
                return f"process {other.pid} is not running"
            if locked:
                return f"process {other.pid} is alive but does not hold the lock (its id was reused)"
            return None
        age = time.time() - os.fstat(fd).st_mtime
        if age > self.stale_after_s:
            return f"no heartbeat for {age:.0f} s (more than {self.stale_after_s:.0f} s)"
        return None

    def _busy(self, other: Optional[LockRecord], orphaned: bool = False) -> str:
        who = other.describe() if other is not None else "a run that has not written its record yet"
        if orphaned:
            return (f"the --save folder {self.folder} is locked by processes left behind by a run that died "
                    f"({who}; its process is gone, but a process it started still holds {self.path}): end them")
        return f"the --save folder {self.folder} is in use by another run ({who}); lock file {self.path}"

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            fd = self._fd
            if fd is None:
                return
            try:
                os.utime(fd)
            except OSError:
                pass  # a missed heartbeat only matters after stale_after_s; the next one may succeed

    # ---- giving it back ---------------------------------------------------------------------------------
    def release(self) -> None:
        """Remove the lock file (when it is still ours) and drop the flock. Safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.discard(self)
        self._stop.set()
        try:
            if self._same_file(fd) and _read_record(fd) == self.record:
                os.remove(self.path)
        except OSError:
            pass
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(fd)
        atexit.unregister(self.release)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def acquire_for_job(folder: str, **kwargs) -> Optional[RunLock]:
    """Collective: global rank 0 locks ``folder``; on failure every rank raises the same ``RunLockError``.

    Returns the held lock on rank 0 (its ``note`` names a stale lock that was taken over), None elsewhere.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    lock, message = None, None
    if not distributed or dist.get_rank() == 0:
        try:
            lock = RunLock(folder, **kwargs).acquire()
        except RunLockError as exc:
            message = str(exc)
    if distributed:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise RunLockError(message)
    return lock
