"""The run lock on a --save folder: a second run fails at start naming the first; stale locks are taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from megatron.training.run_lock import LOCK_NAME, RunLock, RunLockError, acquire_for_job
from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

HOLDER = textwrap.dedent("""
    import sys
    from megatron.training.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    sys.stdin.readline()
""")

TAKER = textwrap.dedent("""
    import sys
    from megatron.training.run_lock import RunLock, RunLockError
    try:
        RunLock(sys.argv[1]).acquire()
    except RunLockError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print("locked")
""")


def _python(code, folder, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-c", code, folder], env=env, text=True, **kw)


def _write_record(folder, host, pid, started=1_700_000_000.0):
    path = os.path.join(folder, LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": pid, "started": started, "command": "pretrain_gpt.py"}, f)
    return path


def test_record_and_release(tmp_path):
    lock = RunLock(str(tmp_path)).acquire()
    body = json.load(open(tmp_path / LOCK_NAME))
    assert body["host"] == socket.gethostname() and body["pid"] == os.getpid()
    assert abs(body["started"] - time.time()) < 60 and lock.note is None
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    lock.release()  # twice is harmless
    with RunLock(str(tmp_path)):
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()


def test_second_process_fails_naming_the_first(tmp_path):
    with RunLock(str(tmp_path)) as lock:
        taker = _python(TAKER, str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = taker.communicate(timeout=120)
        assert taker.returncode == 2, (out, err)
        line = err.strip()
        assert "\n" not in line
        assert f"the --save folder {tmp_path} is in use by another run" in line
        assert f"host {socket.gethostname()}, pid {os.getpid()}, since " in line
        since = time.strftime("%Y-%m-%d %H:%M", time.gmtime(lock.record.started))
        assert since in line
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_held_by_another_process(tmp_path):
    holder = _python(HOLDER, str(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError, match=f"pid {holder.pid}, since"):
            RunLock(str(tmp_path)).acquire()
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / LOCK_NAME).exists()  # released at exit
    RunLock(str(tmp_path)).acquire().release()


def test_killed_holder_leaves_a_stale_lock_that_is_taken_over(tmp_path):
    holder = _python(HOLDER, str(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert json.load(open(tmp_path / LOCK_NAME))["pid"] == holder.pid  # no exit handler ran
    lock = RunLock(str(tmp_path)).acquire()
    try:
        assert f"pid {holder.pid}" in lock.note and f"process {holder.pid} is not running" in lock.note
        assert json.load(open(tmp_path / LOCK_NAME))["pid"] == os.getpid()
    finally:
        lock.release()


def test_stale_records_on_this_host(tmp_path, dead_pid):
    here = socket.gethostname()
    _write_record(str(tmp_path), here, dead_pid)
    with RunLock(str(tmp_path)) as lock:
        assert "is not running" in lock.note
    _write_record(str(tmp_path), here, os.getpid())  # a restarted container: same id, nobody holds it
    with RunLock(str(tmp_path)) as lock:
        assert "carries this process's id" in lock.note
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # a live process that does not hold the flock: its id was reused by an unrelated program
        _write_record(str(tmp_path), here, sleeper.pid)
        with RunLock(str(tmp_path)) as lock:
            assert "does not hold the lock" in lock.note
    finally:
        sleeper.kill()
        sleeper.wait()


def test_other_host_needs_an_old_heartbeat(tmp_path):
    path = _write_record(str(tmp_path), "node-b.cluster", 4242)
    with pytest.raises(RunLockError, match="in use by another run \\(host node-b.cluster, pid 4242, since "
                                           "2023-11-14 22:13:20 UTC\\)"):
        RunLock(str(tmp_path), stale_after_s=300).acquire()
    old = time.time() - 3600
    os.utime(path, (old, old))
    with RunLock(str(tmp_path), stale_after_s=300) as lock:
        assert "node-b.cluster" in lock.note and "no heartbeat for" in lock.note


def test_heartbeat_touches_the_file(tmp_path):
    with RunLock(str(tmp_path), heartbeat_s=0.05):
        path = tmp_path / LOCK_NAME
        os.utime(path, (1_000_000, 1_000_000))
        deadline = time.time() + 30
        while os.stat(path).st_mtime < 2_000_000 and time.time() < deadline:
            time.sleep(0.05)
        assert os.stat(path).st_mtime > time.time() - 60


def test_same_process_second_lock_object_is_refused(tmp_path):
    with RunLock(str(tmp_path)):
        with pytest.raises(RunLockError, match=f"pid {os.getpid()}"):
            RunLock(str(tmp_path)).acquire()


def _job_lock(rank, world_size, folder):
    import torch.distributed as dist

    lock = acquire_for_job(folder)
    assert (lock is not None) == (rank == 0)
    if lock is not None:
        lock.release()
        _write_record(folder, "node-b.cluster", 4242, started=time.time())  # a live run on another host
    dist.barrier()
    with pytest.raises(RunLockError, match="in use by another run \\(host node-b.cluster, pid 4242, since"):
        acquire_for_job(folder)


def test_job_lock_every_rank_gets_the_same_error(tmp_path):
    run_distributed(_job_lock, world_size=2, args=(str(tmp_path),))
