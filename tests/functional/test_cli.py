"""The command line end to end: one error line under torchrun, launchers, timeouts, signals, mock data."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.functional.harness import ROOT, _free_port, gpt_args, parse_iterations, run_pretrain


def _error_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _no_rank_traceback(stderr: str) -> bool:
    """No traceback frame from this project's files (torchrun's own failure report is the launcher's)."""
    return f'File "{ROOT}' not in stderr and "[rank" not in stderr


def test_configuration_error_under_torchrun_is_one_line(data_prefix):
    proc = run_pretrain(gpt_args(data_prefix, global_batch_size=7), nproc=4, expect_ok=False, timeout=300)
    assert proc.returncode != 0
    assert _error_lines(proc.stderr) == [
        "error: --global-batch-size (7) must be a multiple of --micro-batch-size (2) x data-parallel size (4) = 8"]
    assert "usage:" not in proc.stderr and _no_rank_traceback(proc.stderr)


def test_single_process_configuration_error_exits_2_without_usage(data_prefix):
    proc = run_pretrain(gpt_args(data_prefix) + ["--hiden-size", "8"], expect_ok=False)
    assert proc.returncode == 2 and "usage:" not in proc.stderr
    assert _error_lines(proc.stderr) == ["error: unrecognized arguments: --hiden-size 8 (did you mean --hidden-size or --ffn-hidden-size?)"]


def test_data_error_on_rank_0_reaches_every_rank_as_one_line(data_prefix, tmp_path):
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the index cache folder should be")
    proc = run_pretrain(gpt_args(data_prefix, data_cache_path=str(not_a_folder)), nproc=2, expect_ok=False,
                        timeout=300)
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "--data-cache-path" in lines[0] and str(not_a_folder) in lines[0]
    assert "Connection closed" not in proc.stderr and _no_rank_traceback(proc.stderr)


def test_torch_distributed_launch_without_use_env_trains(data_prefix):
    """torch.distributed.launch passes --local-rank=N on the command line (no --use_env)."""
    proc = run_pretrain(gpt_args(data_prefix, train_iters=2), nproc=2, launcher="torch.distributed.launch",
                        timeout=300)
    assert sorted(parse_iterations(proc.stdout)) == [1, 2]
    assert proc.stdout.count("note: --local-rank=0 is an older spelling; using the LOCAL_RANK environment") <= 1


def _wait_gone(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` exits (or is a zombie) within ``seconds``."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


def test_frozen_rank_is_named_within_the_timeout(data_prefix, tmp_path):
    """--distributed-timeout-minutes 0.5 with one rank stopped (SIGSTOP): within about 30 s the other rank's
    collective times out and it prints one line naming the frozen rank, its host and pid (read from the
    heartbeats every rank keeps in the c10d store), then exits. (torchrun then ends the job: it sends SIGTERM to
    the stopped worker, which cannot act on it, and SIGKILL 30 s later; the test kills it at once.)"""
    log_path = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           os.path.join(ROOT, "pretrain_gpt.py")] + gpt_args(data_prefix, train_iters=100000, num_layers=2,
                                                              distributed_timeout_minutes=0.5)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    workers, named, launched = [], None, time.time()
    try:
        deadline = time.time() + 300
        while len(parse_iterations(log_path.read_text())) < 2:
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            workers = [int(pid) for pid in f.read().split()]
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.time()
        while named is None and time.time() < stopped_at + 150:
            named = next((line for line in log_path.read_text().splitlines()
                          if line.startswith("error:") and "stopped responding" in line), None)
            time.sleep(0.5)
        took = time.time() - stopped_at
        survivor_gone = named is not None and _wait_gone(workers[0], 30)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert named is not None, log_path.read_text()[-3000:]
    assert survivor_gone, "the rank that named the frozen one did not exit"
    assert 20 <= took <= 90, f"the frozen rank was named {took:.0f} s after it froze"
    print(f"named after {took:.0f} s; started {stopped_at - launched:.0f} s after launch")
    assert re.fullmatch(r"error: rank (\d) \(host \S+, pid (\d+), last at iteration \d+\) has stopped responding "
                        r"\(no heartbeat for \d+ s\); rank (\d) waited in a collective longer than "
                        r"--distributed-timeout-minutes 0.5", named), named
    frozen_rank, pid, reporter = re.match(r"error: rank (\d) .*?pid (\d+).*; rank (\d)", named).groups()
    assert int(pid) == workers[1] and frozen_rank != reporter


def test_mock_data_trains_without_a_dataset():
    argv = [a for a in gpt_args("unused", train_iters=3) if a not in ("--data-path", "unused")] + ["--mock-data"]
    proc = run_pretrain(argv)
    its = parse_iterations(proc.stdout)
    assert sorted(its) == [1, 2, 3] and "mock GPT datasets" in proc.stdout
    # random tokens over a 50k vocabulary: the loss starts near ln(50257) and stays high
    assert all(10.0 < its[i]["lm loss"] < 11.5 for i in its)


def test_exit_signal_handler_finishes_the_iteration_saves_and_exits_zero(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + gpt_args(
        data_prefix, train_iters=100000, save=str(ckpt), exit_signal_handler=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    for line in proc.stdout:
        if parse_iterations(line):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    done = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    assert f"exiting at iteration {done} (exit-signal-handler)" in out
    assert (ckpt / f"iter_{int(done):07d}" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_non_finite_loss_stops_with_one_line(data_prefix):
    # an absurd learning rate drives the fp32 weights to inf within a few steps; the check is on by default
    proc = run_pretrain(gpt_args(data_prefix, train_iters=20, lr=1e30, min_lr=0, lr_warmup_iters=0, clip_grad=0),
                        expect_ok=False)
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: iteration ") and "is not finite (--check-for-nan-in-loss-and-grad)" in lines[0]


def test_use_checkpoint_args_resumes_without_the_model_flags(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_pretrain(gpt_args(data_prefix, train_iters=2, save=str(ckpt), num_layers=2, hidden_size=48,
                          num_attention_heads=3))
    shape = {"num-layers", "hidden-size", "num-attention-heads", "seq-length", "max-position-embeddings"}
    argv, skip = [], False
    for tok in gpt_args(data_prefix, train_iters=3, load=str(ckpt), use_checkpoint_args=True):
        if skip:
            skip = False
        elif tok.startswith("--") and tok[2:] in shape:
            skip = True
        else:
            argv.append(tok)
    proc = run_pretrain(argv)
    assert "loaded checkpoint from" in proc.stdout and sorted(parse_iterations(proc.stdout)) == [3]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (optional extra)")
def test_wandb_offline_logging(data_prefix, tmp_path):
    proc = run_pretrain(gpt_args(data_prefix, train_iters=2, wandb_project="cli-test", wandb_exp_name="tiny",
                                 wandb_save_dir=str(tmp_path / "wandb")), env={"WANDB_MODE": "offline"})
    assert sorted(parse_iterations(proc.stdout)) == [1, 2]
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_preprocess_accepts_dataset_impl_mmap(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello world"}\n{"text": "a second document"}\n')
    base = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(src),
            "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", os.path.join(ROOT, "data/gpt2-vocab.json"),
            "--merge-file", os.path.join(ROOT, "data/gpt2-merges.txt"), "--quiet"]
    for flag in ("--dataset-impl", "--data-impl"):
        proc = subprocess.run(base + [flag, "mmap"], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "out_text_document.idx").is_file()
    proc = subprocess.run(base + ["--dataset-impl", "lazy"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "invalid choice: 'lazy'" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_backend_on_a_cpu_machine_is_a_clear_error(data_prefix):
    proc = run_pretrain(gpt_args(data_prefix, distributed_backend="nccl"), expect_ok=False)
    assert proc.returncode == 2
    assert _error_lines(proc.stderr) == [
        "error: --distributed-backend nccl needs CUDA GPUs; this machine has none (use --distributed-backend gloo)"]
