"""Runs that cannot make progress stop with one line: consecutive skipped updates (fp16 overflow at a fixed or
collapsed loss scale)."""

import json
import os

import pytest

from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.training.watchdog import SkippedIterationGuard, SkippedIterationsError
from tests.functional.harness import gpt_args, parse_iterations, run_pretrain


def _tiny(data_prefix, **extra):
    # fp16 matmuls are slow on CPU: one layer, hidden 32, one microbatch of 2
    return gpt_args(data_prefix, num_layers=1, hidden_size=32, global_batch_size=2, **extra)


def test_fixed_fp16_loss_scale_that_always_overflows_stops_without_saving(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_pretrain(_tiny(data_prefix, train_iters=20, fp16=True, loss_scale=1e30, save=str(ckpt),
                              save_interval=1, max_consecutive_skipped_iterations=2), expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0] == ("error: iteration 2: 2 consecutive iterations skipped their update (the gradients overflowed "
                         "fp16 at the fixed loss scale 1e+30); stopping without saving "
                         "(--max-consecutive-skipped-iterations 2); use a smaller --loss-scale or leave it out for "
                         "dynamic scaling")
    its = parse_iterations(proc.stdout)
    assert sorted(its) == [1, 2] and its[2]["skipped"] == 2
    # the checkpoint of iteration 1 (a skipped update leaves the weights as they were) is complete; nothing of
    # iteration 2 was written
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert json.load(open(ckpt / "iter_0000001" / "manifest.json"))["files"]
    assert not (ckpt / "iter_0000002").exists()


def test_dynamic_loss_scale_collapse_names_the_minimum():
    """The real dynamic scaler, overflowing at every step: it halves down to --min-loss-scale, then the guard
    stops at the limit, naming the collapse."""
    scaler = DynamicGradScaler(initial_scale=2.0 ** 32, min_scale=1.0, hysteresis=2)
    guard = SkippedIterationGuard(limit=100, fp16=True, fixed_loss_scale=None, min_loss_scale=1.0)
    with pytest.raises(SkippedIterationsError) as err:
        for iteration in range(1, 1000):
            scaler.update(found_inf=True)
            guard.update(iteration, update_ok=False, loss_scale=float(scaler.scale))
    assert iteration == 100 and float(scaler.scale) == 1.0
    assert str(err.value).startswith("iteration 100: 100 consecutive iterations skipped their update (the gradients "
                                     "overflowed fp16 even at the dynamic loss scale's minimum 1)")


def test_skip_count_restarts_after_an_update_and_zero_never_stops():
    guard = SkippedIterationGuard(limit=3, fp16=False, fixed_loss_scale=None, min_loss_scale=1.0)
    for iteration, ok in enumerate([False, False, True, False, False, True], start=1):
        guard.update(iteration, ok, 1.0)  # never three in a row
    guard.update(7, False, 1.0)
    guard.update(8, False, 1.0)
    with pytest.raises(SkippedIterationsError, match=r"^iteration 9: 3 consecutive .*\(the gradient norm was not "
                                                     r"finite"):
        guard.update(9, False, 1.0)
    never = SkippedIterationGuard(limit=0, fp16=True, fixed_loss_scale=1e30, min_loss_scale=1.0)
    for iteration in range(1, 10_000):
        never.update(iteration, False, 1e30)
    assert never.consecutive == 9_999


def test_max_consecutive_skipped_iterations_flag():
    from megatron.training.arguments import parse_config
    from megatron.training.flag_table import ConfigError

    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
    cfg, _ = parse_config(base, world_size=1)
    assert cfg.training.max_consecutive_skipped_iterations == 100
    with pytest.raises(ConfigError, match="--max-consecutive-skipped-iterations must be >= 0"):
        parse_config(base + ["--max-consecutive-skipped-iterations", "-1"], world_size=1)
