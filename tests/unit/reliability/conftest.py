"""Fixtures for fault injection: small real file systems (tmpfs) mounted for one test, and dead process ids."""

import os
import subprocess
import sys

import pytest


def _mount_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")


def _unmount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs: a real disk that fills up (ENOSPC from the kernel, not from a patched call)."""
    mnt = tmp_path / "tiny"
    _mount_tmpfs(mnt, "size=256k")
    yield str(mnt)
    _unmount(mnt)


@pytest.fixture
def readonly_fs(tmp_path):
    """A tmpfs mounted read-only: EROFS even for root, who bypasses chmod."""
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "ro,size=64k")
    yield str(mnt)
    _unmount(mnt)


@pytest.fixture
def dead_pid():
    """The id of a process that has exited (and been reaped) on this host."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
