"""Save / stop / resume gives the losses of an uninterrupted run; bad checkpoints fail clearly."""

import json
import os

import torch

from tests.functional.harness import (assert_same_losses, gpt_args, losses, losses_of_many, parse_iterations,
                                     run_pretrain)


def _resume_equals_straight(data_prefix, tmp_path, nproc, total, stop, one_launch=True, **layout):
    ckpt = str(tmp_path / "ckpt")
    # the uninterrupted run and the one that stops share one launch (unless ``one_launch`` is False); the resumed
    # run starts in a fresh process, so all it knows of the first part comes from the checkpoint
    argvs = [gpt_args(data_prefix, train_iters=total, **layout),
             gpt_args(data_prefix, train_iters=total, exit_interval=stop, save=ckpt, **layout)]
    if one_launch:
        straight, first = losses_of_many(argvs, nproc=nproc)
    else:
        straight, first = (losses(argv, nproc=nproc) for argv in argvs)
    assert sorted(first) == list(range(1, stop + 1))
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == str(stop)
    second = losses(gpt_args(data_prefix, train_iters=total, load=ckpt, **layout), nproc=nproc)
    assert sorted(second) == list(range(stop + 1, total + 1))
    # bit-exact: the printed values are identical, not merely close
    assert_same_losses(straight, {**first, **second}, rel=0.0, keys=("lm loss", "grad norm"))
    return ckpt


def test_resume_is_bit_exact_single_process(data_prefix, tmp_path):
    ckpt = _resume_equals_straight(data_prefix, tmp_path, 1, 20, 10)
    path = os.path.join(ckpt, "iter_0000010", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=True)
    for key in ("args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                "rng_state", "consumed_train_samples"):
        assert key in state, key
    assert state["iteration"] == 10 and state["consumed_train_samples"] == 80
    assert "embedding.word_embeddings.weight" in state["model"]


def test_resume_tp2_pp2(data_prefix, tmp_path):
    ckpt = _resume_equals_straight(data_prefix, tmp_path, 4, 10, 5, tp=2, tensor_model_parallel_size=2,
                                   pipeline_model_parallel_size=2)
    names = sorted(os.listdir(os.path.join(ckpt, "iter_0000005")))
    assert names == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    manifest = json.load(open(os.path.join(ckpt, "iter_0000005", "manifest.json")))
    assert sorted(manifest["files"]) == [f"{n}/model_optim_rng.pt" for n in names[1:]]


def test_resume_distributed_optimizer(data_prefix, tmp_path):
    _resume_equals_straight(data_prefix, tmp_path, 2, 8, 4, use_distributed_optimizer=True)


def test_resume_with_fp8_delayed_scaling_keeps_the_amax_history(data_prefix, tmp_path):
    """The checkpoint holds the delayed-scaling histories and scales, so the resumed run quantizes with the same
    scales as the uninterrupted one: bit-exact on CPU (history 2, max, PP2: two ranks, two registries)."""
    # one_launch=False: a process trains one model with FP8 delayed scaling (its scaling-site registry is per process)
    ckpt = _resume_equals_straight(data_prefix, tmp_path, 2, 10, 5, one_launch=False, bf16=True,
                                   fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2,
                                   fp8_amax_compute_algo="max", pipeline_model_parallel_size=2)
    state = torch.load(os.path.join(ckpt, "iter_0000005", "mp_rank_00_000", "model_optim_rng.pt"),
                       weights_only=True)["fp8_delayed_scaling"]
    assert state["history"].shape[0] == 2 and state["history"].max() > 0 and len(state["state"]) > 0


def test_missing_and_corrupt_checkpoints_fail_clearly(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_pretrain(gpt_args(data_prefix, train_iters=2, save=str(ckpt)))
    # corrupt tracker
    (ckpt / "latest_checkpointed_iteration.txt").write_text("garbage")
    proc = run_pretrain(gpt_args(data_prefix, train_iters=4, load=str(ckpt)), expect_ok=False)
    assert proc.returncode == 2 and "corrupt tracker file" in proc.stderr
    # tracker names an iteration whose file is missing
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    proc = run_pretrain(gpt_args(data_prefix, train_iters=4, load=str(ckpt)), expect_ok=False)
    assert proc.returncode == 2 and "iter_0000007" in proc.stderr and "missing" in proc.stderr
    # truncated checkpoint file
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    path = ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:1000])
    proc = run_pretrain(gpt_args(data_prefix, train_iters=4, load=str(ckpt)), expect_ok=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: checkpoint iteration 2: file {path} has 1000 bytes, ")
    assert "were saved (truncated or overwritten)" in proc.stderr
    # --load of a folder that does not exist is an error under --exit-on-missing-checkpoint, before any training
    proc = run_pretrain(gpt_args(data_prefix, train_iters=2, load=str(tmp_path / "nope"),
                                 exit_on_missing_checkpoint=True), expect_ok=False)
    assert proc.returncode == 2 and parse_iterations(proc.stdout) == {}
    assert proc.stderr.strip().splitlines()[-1] == (f"error: --exit-on-missing-checkpoint: the --load folder "
                                                    f"{tmp_path / 'nope'} does not exist")
    # --load of an existing folder with no checkpoint yet (first launch of an auto-resuming script) starts fresh
    (tmp_path / "empty").mkdir()
    proc = run_pretrain(gpt_args(data_prefix, train_iters=2, load=str(tmp_path / "empty")))
    assert "no checkpoint found" in proc.stdout
