"""Checkpoint files: durable writes, manifests, corruption, disk full, read-only folders, stale temp files."""

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from megatron.training import checkpoint_folder as cfold
from megatron.core import checkpoint_io as cio
from megatron.core.checkpoint_io import CheckpointCorruptError, CheckpointIOError
from tests.dist_utils import run_distributed

REL = "mp_rank_00/model_optim_rng.pt"


def _state(seed, n=20000):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g)}, "iteration": seed}


def _save_checkpoint(root, iteration, n=20000):
    """The order a checkpoint save follows: files, manifest, tracker."""
    folder = cfold.iteration_dir(root, iteration)
    rec = cio.save_torch(_state(iteration, n), folder, REL)
    cio.write_manifest(folder, iteration, [rec])
    cio.write_text_durable(os.path.join(root, "latest_checkpointed_iteration.txt"), str(iteration))
    return folder


def _temp_files(root):
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if ".tmp." in n]


def _overwrite_4k(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(4096))


def test_save_records_digest_of_bytes_on_disk(tmp_path):
    folder = str(tmp_path / "iter_0000005")
    rec = cio.save_torch(_state(5), folder, REL)
    path = os.path.join(folder, REL)
    data = open(path, "rb").read()
    assert rec.relpath == REL and rec.size == len(data)
    assert rec.digest == hashlib.sha256(data).hexdigest()  # hashed while written == hashed from disk
    assert torch.equal(torch.load(path, weights_only=True)["model"]["w"], _state(5)["model"]["w"])
    assert _temp_files(tmp_path) == []


def test_manifest_lists_every_file_and_verifies(tmp_path):
    folder = str(tmp_path / "iter_0000007")
    recs = [cio.save_torch(_state(7), folder, REL),
            cio.save_file(folder, "mp_rank_01/extra.bin", lambda f: f.write(b"x" * 1000))]
    cio.write_manifest(folder, 7, recs)
    body = json.load(open(os.path.join(folder, cio.MANIFEST)))
    assert body["iteration"] == 7 and body["algorithm"] == "sha256"
    assert sorted(body["files"]) == [REL, "mp_rank_01/extra.bin"]
    assert body["files"]["mp_rank_01/extra.bin"] == {"size": 1000, "digest": hashlib.sha256(b"x" * 1000).hexdigest()}
    assert cio.verify_checkpoint(folder, 7) is True
    assert cio.verify_checkpoint(folder, 7, [REL]) is True
    os.makedirs(tmp_path / "iter_0000008")
    assert cio.verify_checkpoint(str(tmp_path / "iter_0000008"), 8) is False  # no manifest: unverifiable
    with pytest.raises(CheckpointCorruptError, match="iter_0000009 does not exist"):  # the tracker's typo
        cio.verify_checkpoint(str(tmp_path / "iter_0000009"), 9)


def test_corruption_of_4k_is_one_error_naming_file_and_iteration(tmp_path):
    folder = _save_checkpoint(str(tmp_path), 20)
    path = os.path.join(folder, REL)
    size = os.path.getsize(path)
    _overwrite_4k(path, size // 2)
    assert os.path.getsize(path) == size
    with pytest.raises(CheckpointCorruptError) as info:
        cio.verify_checkpoint(folder, 20, [REL])
    msg = str(info.value)
    assert "\n" not in msg and path in msg and "iteration 20" in msg and "corrupt" in msg
    assert info.value.path == path and info.value.iteration == 20


def test_missing_truncated_and_unlisted_files(tmp_path):
    folder = _save_checkpoint(str(tmp_path), 3)
    path = os.path.join(folder, REL)
    with pytest.raises(CheckpointCorruptError, match="not listed in the manifest"):
        cio.verify_checkpoint(folder, 3, ["mp_rank_01/model_optim_rng.pt"])
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointCorruptError, match="has 1000 bytes"):
        cio.verify_checkpoint(folder, 3)
    os.remove(path)
    with pytest.raises(CheckpointCorruptError, match=f"iteration 3: file {path} is missing"):
        cio.verify_checkpoint(folder, 3)
    with open(os.path.join(folder, cio.MANIFEST), "w") as f:
        f.write("{ not json")
    with pytest.raises(CheckpointCorruptError, match="manifest .* is unreadable"):
        cio.verify_checkpoint(folder, 3)


def test_fallback_finds_newest_intact_checkpoint(tmp_path):
    root = str(tmp_path)
    for it in (10, 20, 30):
        _save_checkpoint(root, it)
    _overwrite_4k(os.path.join(cfold.iteration_dir(root, 30), REL), 8192)
    os.remove(os.path.join(cfold.iteration_dir(root, 20), cio.MANIFEST))  # a save that never completed
    cio.save_torch(_state(40), cfold.iteration_dir(root, 40), REL)  # files but no manifest either
    notes = []
    assert cfold.find_intact_checkpoint(root, log=notes.append) == 10
    assert len(notes) == 3 and "iteration 30" in notes[1] and "corrupt" in notes[1]
    assert cfold.find_intact_checkpoint(root, below=10) is None
    assert cfold.list_iterations(root) == [10, 20, 30, 40]


def _fill_with(payload):
    return lambda f: f.write(payload)


def test_disk_full_on_a_real_tiny_filesystem(tiny_fs):
    root = tiny_fs
    folder = _save_checkpoint(root, 1, n=2000)  # ~8 KB: fits
    before = open(os.path.join(folder, REL), "rb").read()
    with pytest.raises(CheckpointIOError) as info:
        cio.save_torch(_state(2, n=200000), cfold.iteration_dir(root, 2), REL)  # ~800 KB: does not fit
    path = os.path.join(cfold.iteration_dir(root, 2), REL)
    assert str(info.value) == f"no space left on device while writing {path}"
    assert _temp_files(root) == []  # the partial file is gone: the disk is usable again
    assert open(os.path.join(folder, REL), "rb").read() == before
    assert cio.verify_checkpoint(folder, 1) is True
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "1"
    # the same name again: the old complete file survives a failed overwrite
    with pytest.raises(CheckpointIOError, match="no space left"):
        cio.save_file(folder, REL, _fill_with(b"z" * 600_000))
    assert open(os.path.join(folder, REL), "rb").read() == before


def test_disk_full_injected_mid_write(tmp_path, monkeypatch):
    """ENOSPC from the file object after 64 KiB, the way a full network file system reports it."""
    real_open = open

    class FullFile:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 65536:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(cio, "open", lambda p, m="r": FullFile(real_open(p, m)), raising=False)
    path = os.path.join(str(tmp_path), REL)
    with pytest.raises(CheckpointIOError) as info:
        cio.save_torch(_state(2, n=100000), str(tmp_path), REL)
    assert str(info.value) == f"no space left on device while writing {path}"
    assert isinstance(info.value.__cause__, (OSError, RuntimeError))
    assert _temp_files(tmp_path) == [] and not os.path.exists(path)


def test_readonly_save_folder_fails_at_startup(readonly_fs):
    with pytest.raises(CheckpointIOError) as info:
        cfold.check_save_dir_writable(readonly_fs)
    assert str(info.value).startswith(f"cannot write to the --save folder {readonly_fs}: read-only file system")
    with pytest.raises(CheckpointIOError, match="cannot create the --save folder .*read-only file system"):
        cfold.check_save_dir_writable(os.path.join(readonly_fs, "run1"))
    with pytest.raises(CheckpointIOError, match="read-only file system while creating"):
        cio.save_torch(_state(1), cfold.iteration_dir(readonly_fs, 1), REL)


def test_permission_denied_injected(tmp_path, monkeypatch):
    """Root ignores mode bits, so EACCES is injected at the probe's os.open."""
    def refuse(path, *a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    assert cfold.check_save_dir_writable(str(tmp_path)) > 0
    assert os.listdir(tmp_path) == []  # the probe is removed
    monkeypatch.setattr(cfold.os, "open", refuse)
    with pytest.raises(CheckpointIOError, match=r"--save folder .*: permission denied while writing .*write_probe"):
        cfold.check_save_dir_writable(str(tmp_path))


def test_stale_temp_files_of_dead_savers_are_removed(tmp_path, dead_pid):
    host = socket.gethostname()
    folder = tmp_path / "iter_0000002" / "mp_rank_00"
    folder.mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "legacy_dead": f"model_optim_rng.pt.tmp.{dead_pid}",
            "dead": f"model_optim_rng.pt.tmp.{host}.{dead_pid}",
            "own_pid_not_writing": f"model_optim_rng.pt.tmp.{host}.{os.getpid()}",
            "alive": f"model_optim_rng.pt.tmp.{host}.{sleeper.pid}",
            "other_host": "model_optim_rng.pt.tmp.node-b.example.com.4242",
            "unrelated": "model_optim_rng.pt",
        }
        for name in names.values():
            (folder / name).write_bytes(b"partial")
        (tmp_path / f"latest_checkpointed_iteration.txt.tmp.{dead_pid}").write_text("1")
        removed = {os.path.basename(p) for p in cfold.remove_stale_temp_files(str(tmp_path))}
        assert removed == {names["legacy_dead"], names["dead"], names["own_pid_not_writing"],
                           f"latest_checkpointed_iteration.txt.tmp.{dead_pid}"}
        left = set(os.listdir(folder))
        assert left == {names["alive"], names["other_host"], names["unrelated"]}
        removed = {os.path.basename(p) for p in cfold.remove_stale_temp_files(str(tmp_path), quiescent=True)}
        assert removed == {names["other_host"]}
    finally:
        sleeper.kill()
        sleeper.wait()


def test_temp_file_being_written_is_kept(tmp_path, monkeypatch):
    seen = []

    def write(f):
        f.write(b"a" * 100)
        seen.extend(cfold.remove_stale_temp_files(str(tmp_path)))  # a cleanup running during our own save
        seen.extend(cfold.remove_stale_temp_files("."))
        f.write(b"b" * 100)

    monkeypatch.chdir(tmp_path)
    rec = cio.save_file("iter_0000001", "x.bin", write)  # a relative --save path
    assert seen == [] and rec.size == 200 and open(tmp_path / "iter_0000001" / "x.bin", "rb").read()[-1:] == b"b"


def test_prune_keeps_tracker_and_newest(tmp_path):
    root = str(tmp_path)
    for it in (10, 20, 30, 40, 50, 60):
        _save_checkpoint(root, it, n=100)
    cio.write_text_durable(os.path.join(root, "latest_checkpointed_iteration.txt"), "50")
    cio.save_torch(_state(45, 100), cfold.iteration_dir(root, 45), REL)  # a failed save: no manifest
    removed = cfold.prune_checkpoints(root, keep_last=2, tracker_iteration=50)
    assert sorted(os.path.basename(p) for p in removed) == ["iter_0000010", "iter_0000020", "iter_0000030",
                                                            "iter_0000045"]
    assert cfold.list_iterations(root) == [40, 50, 60]  # 60 is newer than the tracker: untouched
    assert cfold.prune_checkpoints(root, keep_last=5, tracker_iteration=50) == []
    assert [os.path.basename(p) for p in cfold.prune_checkpoints(root, 1, 50)] == ["iter_0000040"]
    with pytest.raises(ValueError, match="at least 1"):
        cfold.prune_checkpoints(root, 0, 50)


def test_describe_os_error_lines():
    for code, words in ((errno.ENOSPC, "no space left on device"), (errno.EACCES, "permission denied"),
                        (errno.EROFS, "read-only file system"), (errno.EDQUOT, "disk quota exceeded")):
        assert cio.describe_os_error(OSError(code, os.strerror(code)), "/x/y") == f"{words} while writing /x/y"


def _two_writers(rank, world_size, root):
    folder = cfold.iteration_dir(root, 8)
    rec = cio.save_torch(_state(100 + rank, 500), folder, f"mp_rank_{rank:02d}/model_optim_rng.pt")
    records = cio.gather_records([rec])
    assert len(records) == 2
    if rank == 0:
        cio.write_manifest(folder, 8, records)
    torch.distributed.barrier()
    assert cio.verify_checkpoint(folder, 8, [f"mp_rank_{rank:02d}/model_optim_rng.pt"])
    # a writer that failed: every rank raises its line instead of waiting for its file
    error = None
    if rank == 1:
        try:
            cio.save_file(folder, "mp_rank_01/x.pt", lambda f: _enospc())
        except CheckpointIOError as exc:
            error = exc
    with pytest.raises(CheckpointIOError, match="^no space left on device while writing .*mp_rank_01/x.pt$"):
        cio.gather_records([] if rank else [rec], error)


def _enospc():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_manifest_from_two_ranks(tmp_path):
    run_distributed(_two_writers, world_size=2, args=(str(tmp_path),))
    body = json.load(open(os.path.join(cfold.iteration_dir(str(tmp_path), 8), cio.MANIFEST)))
    assert sorted(body["files"]) == ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]


def _two_rank_checkpoints(root):
    for it in (10, 20):
        folder = cfold.iteration_dir(root, it)
        recs = [cio.save_torch(_state(it + r, 3000), folder, f"mp_rank_{r:02d}/model_optim_rng.pt") for r in (0, 1)]
        cio.write_manifest(folder, it, recs)
    return os.path.join(cfold.iteration_dir(root, 20), "mp_rank_01/model_optim_rng.pt")


def _choose(rank, world_size, root, bad):
    mine = [f"mp_rank_{rank:02d}/model_optim_rng.pt"]
    with pytest.raises(CheckpointCorruptError) as info:  # rank 0's own file is fine: it still stops
        cfold.choose_checkpoint(root, 20, mine)
    assert str(info.value).startswith(f"checkpoint iteration 20: file {bad} is corrupt")
    notes = []
    assert cfold.choose_checkpoint(root, 20, mine, fallback=True, log=notes.append) == 10
    if rank == 0:
        assert notes[-1].endswith("falling back to the intact checkpoint of iteration 10")
    assert cfold.choose_checkpoint(root, 10, mine) == 10


def test_choose_checkpoint_all_ranks_agree(tmp_path):
    root = str(tmp_path)
    bad = _two_rank_checkpoints(root)
    _overwrite_4k(bad, 4096)
    run_distributed(_choose, world_size=2, args=(root, bad))


def test_choose_checkpoint_one_process(tmp_path):
    root = str(tmp_path)
    bad = _two_rank_checkpoints(root)
    rel = ["mp_rank_01/model_optim_rng.pt"]
    assert cfold.choose_checkpoint(root, 20, rel) == 20
    os.remove(bad)
    with pytest.raises(CheckpointCorruptError, match=f"file {bad} is missing"):
        cfold.choose_checkpoint(root, 20, rel)
    assert cfold.choose_checkpoint(root, 20, rel, fallback=True) == 10
    os.remove(os.path.join(cfold.iteration_dir(root, 10), cio.MANIFEST))  # 10 is no longer known to be complete
    with pytest.raises(CheckpointCorruptError, match=f"{bad} is missing; no earlier intact checkpoint under"):
        cfold.choose_checkpoint(root, 20, rel, fallback=True)
    notes = []
    assert cfold.choose_checkpoint(root, 10, rel, log=notes.append) == 10  # no manifest: loaded unverified
    assert notes == [f"checkpoint iteration 10 in {cfold.iteration_dir(root, 10)} has no manifest: loaded without "
                     "verification"]


def test_model_and_optimizer_state_round_trip_through_the_save_sequence(tmp_path):
    """The wired order (files, manifest, cleanup, tracker, pruning) with a real model and Adam state."""
    root = str(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saved = {}
    for iteration in (1, 2, 3):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        state = {"iteration": iteration, "model": model.state_dict(), "optimizer": opt.state_dict()}
        saved[iteration] = {k: v.clone() for k, v in model.state_dict().items()}
        folder = cfold.iteration_dir(root, iteration)
        records = cio.gather_records([cio.save_torch(state, folder, REL)])
        cio.write_manifest(folder, iteration, records)
        cfold.remove_stale_temp_files(root, quiescent=True)
        cio.write_text_durable(os.path.join(root, "latest_checkpointed_iteration.txt"), str(iteration))
        cfold.prune_checkpoints(root, keep_last=2, tracker_iteration=iteration)
    assert cfold.list_iterations(root) == [2, 3]
    _overwrite_4k(os.path.join(cfold.iteration_dir(root, 3), REL), 0)
    tracker = int(open(os.path.join(root, "latest_checkpointed_iteration.txt")).read())
    chosen = cfold.choose_checkpoint(root, tracker, [REL], fallback=True)
    assert chosen == 2
    state = torch.load(os.path.join(cfold.iteration_dir(root, chosen), REL), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    assert state["iteration"] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[2][k])


def test_resave_of_an_iteration_invalidates_its_manifest_first(tmp_path):
    root = str(tmp_path)
    folder = _save_checkpoint(root, 100)
    assert cio.invalidate_manifest(folder) is True and cio.invalidate_manifest(folder) is False
    cio.save_torch(_state(7), folder, REL)  # new bytes; the save dies before its manifest
    assert cio.verify_checkpoint(folder, 100) is False  # incomplete, not "corrupt" and not "intact"
    assert cfold.find_intact_checkpoint(root) is None
