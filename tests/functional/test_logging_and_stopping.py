"""Validation/test lines with perplexity, TensorBoard scalars, and the stopping flags."""

import math
import os
import re

from tests.functional.harness import gpt_args, parse_iterations, run_pretrain

EVAL = re.compile(r" (validation|test) loss at iteration (\d+) \| lm loss value: ([-+0-9.E]+) \| lm loss PPL: ([-+0-9.E]+) \|")


def test_eval_lines_and_tensorboard(data_prefix, tmp_path):
    tb = tmp_path / "tb"
    proc = run_pretrain(gpt_args(data_prefix, train_iters=6, eval_interval=3, eval_iters=2, split="90,8,2",
                                 tensorboard_dir=str(tb), log_throughput=True))
    evals = [(m.group(1), int(m.group(2)), float(m.group(3)), float(m.group(4))) for m in EVAL.finditer(proc.stdout)]
    assert [(k, it) for k, it, _, _ in evals] == [("validation", 3), ("validation", 6), ("test", 6)]
    for _, _, loss, ppl in evals:
        assert math.isclose(ppl, math.exp(loss), rel_tol=1e-5)
    assert "training finished at iteration 6" in proc.stdout
    assert "throughput per GPU (TFLOP/s/GPU)" in proc.stdout and "tokens per second per GPU" in proc.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "loss-scale", "batch-size", "throughput-tflops-per-gpu",
                "tokens-per-sec", "lm loss validation", "lm loss validation ppl"):
        assert tag in tags, (tag, tags)
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2, 3, 4, 5, 6]


def test_exit_duration_saves_then_exits_zero(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_pretrain(gpt_args(data_prefix, train_iters=50, exit_duration_in_mins=0.0, save=str(ckpt)))
    assert sorted(parse_iterations(proc.stdout)) == [1]
    assert "exiting at iteration 1 (exit-duration-in-mins)" in proc.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert os.path.isfile(ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")


def test_train_samples_sets_iterations(data_prefix):
    proc = run_pretrain(gpt_args(data_prefix, train_iters=None, train_samples=24))
    assert sorted(parse_iterations(proc.stdout)) == [1, 2, 3]
