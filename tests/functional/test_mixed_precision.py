"""bf16, FP8 and fp16 training through pretrain_gpt.py on CPU: the loss falls; FP8 tracks bf16 (also under
TP+SP, PP2, DP2, and with delayed scaling); fp16 overflows skip and halve the scale."""

import pytest

from tests.functional.harness import assert_same_losses, gpt_args

# Per-iteration tolerances of the mixed-precision curves against their reference, relative to a loss of about 10.
# On this model (10 iterations, same data and initialisation) rounding alone keeps bf16 (fp32 main params) within
# 5e-4 of the fp32 loss at every iteration, and the FP8 runs below (hybrid and e4m3; TP2+SP, PP2, DP2, delayed
# scaling) within 4e-3 of bf16. A real regression moves the curve by a sizeable part of one iteration's progress
# (0.02-0.25 here): a learning rate only 10% too high already differs from bf16 by 5e-3 at iteration 3, 1.7e-2 at
# iteration 4 and 3.4e-2 at iteration 5. So each comparison allows a few times its rounding spread and no more
# (3e-3 and 1e-2 absolute): it still fails on such a change within a few iterations, and a wrong gradient or
# scale fails at once.
BF16_REL = 3e-4
FP8_REL = 1e-3

# name: (processes, flags); the runs of one world size train one after another in one launch
FP8_LAYOUTS = {
    "hybrid": (1, {"fp8_format": "hybrid"}),
    "e4m3": (1, {"fp8_format": "e4m3"}),
    "hybrid-tp2-sp": (2, {"fp8_format": "hybrid", "tp": 2, "sequence_parallel": True}),
    "hybrid-pp2": (2, {"fp8_format": "hybrid", "pipeline_model_parallel_size": 2}),
    # the FP8 weight gradients go into main_grad, which the buckets reduce-scatter as they fill
    "hybrid-dp2-distopt-overlap": (2, {"fp8_format": "hybrid", "use_distributed_optimizer": True,
                                       "overlap_grad_reduce": True, "ddp_bucket_size": 20000}),
    "delayed-most-recent": (1, {"fp8_format": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 1,
                                "fp8_amax_compute_algo": "most_recent"}),
    "delayed-max-of-4-pp2": (2, {"fp8_format": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 4,
                                 "fp8_amax_compute_algo": "max", "pipeline_model_parallel_size": 2}),
    "delayed-most-recent-tp2-sp": (2, {"fp8_format": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 1,
                                       "fp8_amax_compute_algo": "most_recent", "tp": 2, "sequence_parallel": True}),
}


@pytest.fixture(scope="module")
def runs(data_prefix, run_cache):
    jobs = {"fp32": (1, gpt_args(data_prefix)), "bf16": (1, gpt_args(data_prefix, bf16=True)),
            "fp16": (1, gpt_args(data_prefix, fp16=True, initial_loss_scale=2.0**40, hysteresis=1, train_iters=40,
                                 lr_decay_style="constant", lr_warmup_iters=0))}
    delayed = {}
    for name, (nproc, flags) in FP8_LAYOUTS.items():
        (delayed if "fp8_recipe" in flags else jobs)[name] = (nproc, gpt_args(data_prefix, bf16=True, **flags))
    # a process trains one model with FP8 delayed scaling (its scaling-site registry is per process)
    return {**run_cache.losses(jobs), **run_cache.losses(delayed, launch_each=True)}


def test_bf16_trains_and_tracks_fp32(runs):
    run = runs["bf16"]
    assert run[10]["lm loss"] < run[1]["lm loss"] - 0.5
    assert_same_losses(run, runs["fp32"], rel=BF16_REL)  # bf16 weights/activations with fp32 main params
    assert all(v["skipped"] == 0 and v["nan"] == 0 for v in run.values())


@pytest.mark.parametrize("layout", ["hybrid", "e4m3", "hybrid-tp2-sp", "hybrid-pp2", "hybrid-dp2-distopt-overlap"])
def test_fp8_trains_and_tracks_bf16(runs, layout):
    run = runs[layout]
    assert run[10]["lm loss"] < run[1]["lm loss"] - 0.5
    assert_same_losses(run, runs["bf16"], rel=FP8_REL)  # FP8 GEMMs (3 or 2 mantissa bits) on top of bf16
    assert all(v["skipped"] == 0 and v["nan"] == 0 for v in run.values())


@pytest.mark.parametrize("layout", ["delayed-most-recent", "delayed-max-of-4-pp2", "delayed-most-recent-tp2-sp"])
def test_fp8_delayed_scaling_trains_and_tracks_bf16(runs, layout):
    run = runs[layout]
    assert run[10]["lm loss"] < run[1]["lm loss"] - 0.5
    assert_same_losses(run, runs["bf16"], rel=FP8_REL)
    assert all(v["skipped"] == 0 and v["nan"] == 0 for v in run.values())


def test_fp16_dynamic_loss_scale_skips_overflows_then_trains(runs):
    run = runs["fp16"]
    scales = [run[i]["loss scale"] for i in sorted(run)]
    skipped = [run[i]["skipped"] for i in sorted(run)]
    # each overflow skips the step and halves the scale (hysteresis 1) until the gradients fit in fp16
    first_ok = next(i for i in range(1, len(skipped)) if skipped[i] == skipped[i - 1])
    assert first_ok >= 2 and skipped[first_ok - 1] == first_ok
    for i in range(first_ok):
        assert scales[i] == 2.0**40 / 2 ** (i + 1)
    assert run[40]["lm loss"] < run[first_ok + 1]["lm loss"] - 0.3  # then it trains
    assert all(v["nan"] == 0 for v in run.values())  # overflow skips are not NaN iterations
