"""End-to-end faults through pretrain_gpt.py: damaged checkpoints, a second run, a read-only --save, stale
temporary files, token ids beyond the vocabulary, sentence-level data, an exit signal under torchrun.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tests.functional.harness import ROOT, _free_port, gpt_args, parse_iterations, run_pretrain


def _last_line(proc):
    return proc.stderr.strip().splitlines()[-1]


def test_damaged_checkpoint_is_one_line_or_falls_back(data_prefix, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_pretrain(gpt_args(data_prefix, train_iters=4, save_interval=2, save=ckpt))
    manifest = json.load(open(os.path.join(ckpt, "iter_0000004", "manifest.json")))
    assert list(manifest["files"]) == ["mp_rank_00/model_optim_rng.pt"]
    path = os.path.join(ckpt, "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(os.urandom(4096))
    proc = run_pretrain(gpt_args(data_prefix, train_iters=6, load=ckpt), expect_ok=False)
    assert proc.returncode == 2
    assert _last_line(proc) == (f"error: checkpoint iteration 4: file {path} is corrupt (its sha256 differs from "
                                "the one recorded when it was saved)")
    proc = run_pretrain(gpt_args(data_prefix, train_iters=6, load=ckpt, ckpt_fallback_on_corruption=True))
    assert "falling back to the intact checkpoint of iteration 2" in proc.stdout
    assert min(parse_iterations(proc.stdout)) == 3


def test_stale_temp_file_of_a_dead_saver_is_removed_at_the_next_save(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_pretrain(gpt_args(data_prefix, train_iters=2, save=str(ckpt)))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = ckpt / "iter_0000002" / "mp_rank_00" / f"model_optim_rng.pt.tmp.{dead.pid}"
    stale.write_bytes(b"\0" * 100_000)  # what a saver killed in the middle of torch.save leaves
    run_pretrain(gpt_args(data_prefix, train_iters=4, load=str(ckpt), save=str(ckpt)))
    assert not stale.exists()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_second_run_on_the_same_save_folder_fails_at_start(data_prefix, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from megatron.training.run_lock import RunLock; "
         "RunLock(sys.argv[1]).acquire(); print('locked', flush=True); sys.stdin.readline()", ckpt],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = run_pretrain(gpt_args(data_prefix, train_iters=2, save=ckpt), expect_ok=False)
        assert proc.returncode == 2 and parse_iterations(proc.stdout) == {}
        assert _last_line(proc).startswith(f"error: the --save folder {ckpt} is in use by another run "
                                           f"(host ")
        assert f"pid {holder.pid}, since " in _last_line(proc)
    finally:
        holder.kill()
        holder.wait()
    proc = run_pretrain(gpt_args(data_prefix, train_iters=2, save=ckpt))  # the killed holder's lock is stale
    assert f"took over the stale lock {ckpt}/run.lock" in proc.stdout
    assert not os.path.exists(os.path.join(ckpt, "run.lock"))  # released at exit


def test_read_only_save_folder_fails_before_training(data_prefix, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("mounting a read-only tmpfs is not permitted here")
    try:
        proc = run_pretrain(gpt_args(data_prefix, train_iters=2, save=str(ro)), expect_ok=False)
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
    assert proc.returncode == 2 and parse_iterations(proc.stdout) == {}
    assert _last_line(proc).startswith(f"error: cannot write to the --save folder {ro}: read-only file system")


def _dataset(prefix, docs, sentences=False):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        if sentences:
            b.add_document(np.concatenate(doc), [len(s) for s in doc])
        else:
            b.add_item(np.concatenate(doc))
            b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def test_token_ids_beyond_the_vocabulary_and_sentence_data(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 50000, size=200)] for _ in range(200)]
    docs[50][0][7] = 60000  # GPT-2's vocabulary padded to 50,688 rows
    bad = _dataset(str(tmp_path / "bad_text_document"), docs)
    proc = run_pretrain(gpt_args(bad, train_iters=2), expect_ok=False)
    assert proc.returncode == 2 and parse_iterations(proc.stdout) == {}
    assert _last_line(proc).startswith(f"error: {bad}.bin: token id 60000 (largest in the file, first in "
                                       "sequence 50) is not below the model's vocabulary size")
    docs[50][0][7] = 5
    sentences = [[d[0][:100], d[0][100:]] for d in docs]
    prefix = _dataset(str(tmp_path / "corpus_text_sentence"), sentences, sentences=True)
    proc = run_pretrain(gpt_args(prefix, train_iters=2))
    assert "is sentence-level data: 400 sequences in 200 documents" in proc.stdout + proc.stderr


def test_evaluation_of_a_non_finite_loss_prints_nan_not_a_perplexity():
    from megatron.training.logging import format_eval_line, perplexity

    line = format_eval_line("validation loss at iteration 4", {"lm loss": float("nan")})
    assert line == " validation loss at iteration 4 | lm loss value: nan | lm loss PPL: nan |"
    line = format_eval_line("test loss at iteration 4", {"lm loss": float("inf")})
    assert line == " test loss at iteration 4 | lm loss value: inf | lm loss PPL: inf |"
    assert perplexity(30.0) == perplexity(20.0) > 4.8e8  # finite losses keep Megatron's cap at exp(20)


@pytest.mark.parametrize("layout", [{"tp": 2, "tensor_model_parallel_size": 2},
                                    {"pipeline_model_parallel_size": 2}], ids=["tp2", "pp2"])
def test_empty_test_split_is_skipped_by_every_rank(data_prefix, layout):
    """--split 98,2,0 leaves no test data: every rank skips the end-of-run test evaluation together (a rank that
    entered it alone would wait for its peers until the timeout)."""
    proc = run_pretrain(gpt_args(data_prefix, train_iters=2, eval_iters=1, eval_interval=2, split="98,2,0",
                                 distributed_timeout_minutes=1, **layout), nproc=2, timeout=240)
    assert " validation loss at iteration 2 | lm loss value: " in proc.stdout
    assert " test loss at iteration" not in proc.stdout
    assert sorted(parse_iterations(proc.stdout)) == [1, 2]


def test_keep_last_checkpoints_prunes_older_folders(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_pretrain(gpt_args(data_prefix, train_iters=8, save_interval=2, save=str(ckpt), keep_last_checkpoints=2))
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000006", "iter_0000008",
                                                     "latest_checkpointed_iteration.txt"]
    assert (ckpt / "iter_0000006" / "manifest.json").exists()


def test_sigusr1_to_one_rank_under_torchrun_saves_on_every_rank_and_exits_zero(data_prefix, tmp_path):
    """SLURM's --signal=USR1@120 pre-warning: with --exit-signal-handler --exit-signal SIGUSR1 under torchrun
    (TP=2), a SIGUSR1 that reaches only one rank stops both after the iteration in progress; every rank saves its
    part of the checkpoint and the job exits 0."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           os.path.join(ROOT, "pretrain_gpt.py")] + gpt_args(
        data_prefix, tp=2, tensor_model_parallel_size=2, num_layers=2, train_iters=100000, save=str(ckpt),
        exit_signal_handler=True, exit_signal="SIGUSR1")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if parse_iterations(line):
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    workers = [int(pid) for pid in f.read().split()]
                os.kill(workers[-1], signal.SIGUSR1)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen) + out
    assert proc.returncode == 0, err[-3000:]
    done = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert "> --exit-signal SIGUSR1 received: saving a checkpoint and exiting" in out
    assert f"exiting at iteration {done} (exit-signal-handler)" in out
    assert max(parse_iterations(out)) == done < 100000
    manifest = json.load(open(ckpt / f"iter_{done:07d}" / "manifest.json"))
    assert sorted(manifest["files"]) == ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]
