"""Faults as a cluster produces them, through pretrain_gpt.py and torchrun: stop signals sent to whole process
groups (DataLoader workers included), a rank SIGKILLed under ``torchrun --max-restarts``, a trainer SIGKILLed
and started again on the same folder, a rank killed without a launcher, and the first launch of a script whose
--save and --load folder does not exist yet."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.functional.harness import ROOT, _free_port, assert_same_losses, gpt_args, parse_iterations

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _torchrun(nproc, argv, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(_free_port()), *extra, os.path.join(ROOT, "pretrain_gpt.py")] + argv


def _start(cmd, env=None, **kw):
    """A process in a session (and process group) of its own, as a scheduler starts a job step."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env or ENV, start_new_session=True, **kw)


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])


def _gone(pid):
    """The process has ended (a zombie that nobody reaped yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _read_until(proc, iteration, seen):
    """Read stdout lines until the log line of ``iteration`` (or the end); returns True when it came."""
    for line in proc.stdout:
        seen.append(line)
        its = parse_iterations(line)
        if its and max(its) >= iteration:
            return True
    return False


def _finish(proc, seen, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return "".join(seen) + out, err


def _saved_on_every_rank(ckpt, files):
    done = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    manifest = json.load(open(ckpt / f"iter_{done:07d}" / "manifest.json"))
    assert sorted(manifest["files"]) == files
    return done


@pytest.mark.parametrize("name", ["SIGTERM"])
def test_stop_signal_to_the_process_group_of_a_run_with_dataloader_workers(data_prefix, tmp_path, name):
    """SLURM, systemd and Kubernetes signal the whole process group: the DataLoader workers (--num-workers 2,
    the default) receive the signal too, ignore it, and the trainer finishes its iteration, saves, exits 0."""
    ckpt = tmp_path / "ckpt"
    argv = gpt_args(data_prefix, num_layers=2, train_iters=100000, save=str(ckpt), num_workers=None,
                    exit_signal_handler=True, exit_signal=name)
    proc, seen = _start([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + argv), []
    assert _read_until(proc, 2, seen), proc.stderr.read()[-3000:]
    assert len(_children(proc.pid)) >= 2  # the DataLoader workers
    os.killpg(proc.pid, getattr(signal, name))
    out, err = _finish(proc, seen)
    assert proc.returncode == 0, err[-3000:]
    done = _saved_on_every_rank(ckpt, ["mp_rank_00/model_optim_rng.pt"])
    assert f"exiting at iteration {done} (exit-signal-handler)" in out and max(parse_iterations(out)) == done


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_stop_signal_to_torchrun_saves_on_every_rank(data_prefix, tmp_path, name):
    """TP 2 under torchrun, --num-workers 2 (the default). SIGTERM: torchrun forwards it to each rank's process
    group; the ranks save and exit 0 and torchrun then exits 1 (its own report of the signal). SIGUSR1: torchrun
    does not forward it and dies of it (status -SIGUSR1); each rank gets the exit signal when its launcher ends
    (PR_SET_PDEATHSIG), so the ranks save and exit all the same instead of training on as orphans."""
    ckpt = tmp_path / "ckpt"
    argv = gpt_args(data_prefix, tp=2, tensor_model_parallel_size=2, num_layers=2, train_iters=100000,
                    save=str(ckpt), num_workers=None, exit_signal_handler=True, exit_signal=name)
    proc, seen = _start(_torchrun(2, argv)), []
    assert _read_until(proc, 2, seen), proc.stderr.read()[-3000:]
    ranks = _children(proc.pid)
    os.killpg(proc.pid, getattr(signal, name))  # torchrun's group: the ranks run in sessions of their own
    out, err = _finish(proc, seen)
    assert proc.returncode == (1 if name == "SIGTERM" else -signal.SIGUSR1), err[-3000:]
    done = _saved_on_every_rank(ckpt, ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"])
    assert f"> --exit-signal {name} received: saving a checkpoint and exiting" in out
    assert f"exiting at iteration {done} (exit-signal-handler)" in out
    # no rank failed: the only traceback is torchrun's own report of the SIGTERM it received
    assert "error:" not in err and err.count("Traceback") == err.count("SignalException: Process "), err[-3000:]
    assert all(_gone(pid) for pid in ranks)


def test_torchrun_restart_after_a_rank_is_killed_resumes_with_the_same_losses(data_prefix, baseline, tmp_path):
    """torchrun --max-restarts 2 (its default static rendezvous keeps one store for every attempt), rank 0 of
    two data-parallel ranks SIGKILLed at iteration 5 (the out-of-memory killer's pattern): the restart resumes
    from the checkpoint of iteration 4 within a minute and every iteration has the loss of one uninterrupted
    process."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    argv = gpt_args(data_prefix, save=str(ckpt), load=str(ckpt), save_interval=2, num_workers=2,
                    distributed_timeout_minutes=1)
    proc, seen = _start(_torchrun(2, argv, "--max-restarts", "2")), []
    assert _read_until(proc, 5, seen), proc.stderr.read()[-3000:]
    victim = next(pid for pid in _children(proc.pid) if _rank_of(pid) == 0)
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    for line in proc.stdout:
        seen.append(line)
        if "> loaded checkpoint from" in line:
            break
    resumed_after = time.time() - killed
    out, err = _finish(proc, seen)
    assert proc.returncode == 0, err[-3000:]
    assert f"> loaded checkpoint from {ckpt} at iteration 4" in out
    assert resumed_after < 60, resumed_after
    after = {}
    for part in out.split("> loaded checkpoint from")[1:]:
        after.update(parse_iterations(part))
    assert sorted(after) == list(range(5, 11))
    assert_same_losses({**parse_iterations(out.split("> loaded checkpoint from")[0]), **after}, baseline)


def test_killed_trainer_next_run_starts_at_once_and_a_lost_rank_is_named(data_prefix, tmp_path):
    """A trainer SIGKILLed (the out-of-memory killer takes only it) leaves no DataLoader worker behind: the next
    run on the same --save takes the lock at once. Two ranks started without a launcher: when one is killed, the
    other names it in one line and exits 1."""
    ckpt = tmp_path / "ckpt"
    argv = gpt_args(data_prefix, num_layers=2, train_iters=100000, save=str(ckpt), num_workers=2)
    proc, seen = _start([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + argv), []
    assert _read_until(proc, 1, seen), proc.stderr.read()[-3000:]
    workers = _children(proc.pid)
    proc.kill()
    proc.wait()
    time.sleep(0.5)
    assert workers and [w for w in workers if not _gone(w)] == []  # died with the trainer
    again = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")]
                           + gpt_args(data_prefix, num_layers=2, train_iters=2, save=str(ckpt)),
                           capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"took over the stale lock {ckpt}/run.lock of host " in again.stdout

    port, ranks = _free_port(), []
    argv = gpt_args(data_prefix, tp=2, tensor_model_parallel_size=2, num_layers=2, train_iters=100000,
                    distributed_timeout_minutes=1)
    try:
        for rank in range(2):
            env = dict(ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            ranks.append(_start([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + argv, env=env))
        assert _read_until(ranks[1], 2, []), ranks[1].stderr.read()[-3000:]  # the last rank logs
        ranks[1].kill()
        start = time.time()
        _, err = ranks[0].communicate(timeout=120)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert ranks[0].returncode == 1 and time.time() - start < 30
    assert err.strip().splitlines()[-1].startswith(f"error: rank 1 (host ")
    assert f", pid {ranks[1].pid}) has died (the process is gone); rank 0 lost its connection to a peer" in err
    assert "Traceback" not in err


def test_first_launch_creates_the_folders_and_starts_from_scratch(data_prefix, tmp_path):
    """The resubmit-the-same-script idiom: --save X --load X with X absent trains, with one note; so does
    --tensorboard-dir X/tb."""
    x = tmp_path / "x"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + gpt_args(
        data_prefix, num_layers=1, train_iters=2, save=str(x), load=str(x), tensorboard_dir=str(x / "tb")),
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("starting from scratch") == 1
    assert f"> no checkpoint found in --load {x}; starting from scratch" in proc.stdout
    assert (x / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(x / "tb"))


def _pretrain(argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + argv, capture_output=True,
                          text=True, cwd=ROOT, env=ENV, timeout=240)


def _one_error_line(proc):
    assert proc.returncode == 2 and parse_iterations(proc.stdout) == {}, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_integrity_holes_give_one_line_or_fall_back(data_prefix, tmp_path):
    """A manifest deleted from a folder this framework wrote, a tracker naming a missing iteration (with
    --ckpt-fallback-on-corruption), a negative tracker, a manifest entry of the wrong type: one line naming
    the file each, or the fall-back."""
    ckpt, data = tmp_path / "ckpt", data_prefix
    base = dict(num_layers=1, train_iters=4)
    proc = _pretrain(gpt_args(data, save=str(ckpt), save_interval=2, **base))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tracker = ckpt / "latest_checkpointed_iteration.txt"

    (ckpt / "iter_0000004" / "manifest.json").unlink()  # deleted: the file says it was saved with one
    line = _one_error_line(_pretrain(gpt_args(data, load=str(ckpt), **base)))
    assert line == (f"error: checkpoint iteration 4: {ckpt}/iter_0000004/manifest.json is missing, but "
                    f"{ckpt}/iter_0000004/mp_rank_00/model_optim_rng.pt was saved with one (the manifest was "
                    "deleted, or the folder was damaged); its files cannot be verified")

    tracker.write_text("7")  # no such iteration: falls back past the manifest-less 4 to the intact 2
    proc = _pretrain(gpt_args(data, load=str(ckpt), ckpt_fallback_on_corruption=True, **base))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint iteration 7: its folder {ckpt}/iter_0000007 does not exist; falling back to the intact " \
           "checkpoint of iteration 2" in proc.stdout
    assert sorted(parse_iterations(proc.stdout)) == [3, 4]

    tracker.write_text("-3")
    assert _one_error_line(_pretrain(gpt_args(data, load=str(ckpt), **base))) == (
        f"error: corrupt tracker file {tracker}: expected a non-negative iteration number or 'release', found '-3'")

    tracker.write_text("2")
    manifest = json.load(open(ckpt / "iter_0000002" / "manifest.json"))
    manifest["files"]["mp_rank_00/model_optim_rng.pt"] = "1234"
    json.dump(manifest, open(ckpt / "iter_0000002" / "manifest.json", "w"))
    line = _one_error_line(_pretrain(gpt_args(data, load=str(ckpt), **base)))
    assert line.startswith(f"error: checkpoint iteration 2: manifest {ckpt}/iter_0000002/manifest.json is "
                           "unreadable (TypeError: the entry of 'mp_rank_00/model_optim_rng.pt' is \"1234\"")
