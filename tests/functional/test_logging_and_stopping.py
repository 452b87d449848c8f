"""Validation/test lines with perplexity, TensorBoard scalars, and the stopping flags."""

import math
import os
import re

import pytest

from tests.functional.harness import gpt_args, outputs_of_many, parse_iterations

EVAL = re.compile(r" (validation|test) loss at iteration (\d+) \| lm loss value: ([-+0-9.E]+) \| lm loss PPL: ([-+0-9.E]+) \|")


@pytest.fixture(scope="module")
def runs(data_prefix, tmp_path_factory):
    """The standard output of each run, and the folder of their files; the runs train one after another in one
    process."""
    tmp = tmp_path_factory.mktemp("logging")
    argvs = {
        "eval": gpt_args(data_prefix, train_iters=6, eval_interval=3, eval_iters=2, split="90,8,2",
                         tensorboard_dir=str(tmp / "tb"), log_throughput=True),
        "exit-duration": gpt_args(data_prefix, train_iters=50, exit_duration_in_mins=0.0, save=str(tmp / "ckpt")),
        "train-samples": gpt_args(data_prefix, train_iters=None, train_samples=24),
    }
    return tmp, dict(zip(argvs, outputs_of_many(list(argvs.values()))))


def test_eval_lines_and_tensorboard(runs):
    tmp, out = runs
    tb, stdout = tmp / "tb", out["eval"]
    evals = [(m.group(1), int(m.group(2)), float(m.group(3)), float(m.group(4))) for m in EVAL.finditer(stdout)]
    assert [(k, it) for k, it, _, _ in evals] == [("validation", 3), ("validation", 6), ("test", 6)]
    for _, _, loss, ppl in evals:
        assert math.isclose(ppl, math.exp(loss), rel_tol=1e-5)
    assert "training finished at iteration 6" in stdout
    assert "throughput per GPU (TFLOP/s/GPU)" in stdout and "tokens per second per GPU" in stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "loss-scale", "batch-size", "throughput-tflops-per-gpu",
                "tokens-per-sec", "lm loss validation", "lm loss validation ppl"):
        assert tag in tags, (tag, tags)
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2, 3, 4, 5, 6]


def test_exit_duration_saves_then_exits_zero(runs):
    tmp, out = runs
    ckpt, stdout = tmp / "ckpt", out["exit-duration"]
    assert sorted(parse_iterations(stdout)) == [1]
    assert "exiting at iteration 1 (exit-duration-in-mins)" in stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert os.path.isfile(ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")


def test_train_samples_sets_iterations(runs):
    assert sorted(parse_iterations(runs[1]["train-samples"])) == [1, 2, 3]
