"""bf16, FP8 and fp16 training through pretrain_gpt.py on CPU: the loss falls; FP8 tracks bf16 (also under
TP+SP, PP2, DP2, and with delayed scaling); fp16 overflows skip and halve the scale."""

import pytest

from tests.functional.harness import gpt_args, losses

# Tolerances per iteration, from measured deviations of these 10-iteration runs (CPU, 2026-12): bf16 vs fp32 at
# most 4.5e-4, FP8 vs bf16 at most 3.5e-3 (e4m3 everywhere), while one iteration lowers the loss by 0.02-0.24
# (0.11 on average). The bounds leave ~3-7x room for CPU-to-CPU rounding differences and still fail on an
# error worth a tenth of an iteration of progress (a wrong scale, a dropped microbatch, a missed gradient).
BF16_VS_FP32 = 3e-3
FP8_VS_BF16 = 1e-2


def test_bf16_trains_and_tracks_fp32(data_prefix, baseline):
    run = losses(gpt_args(data_prefix, bf16=True))
    assert run[10]["lm loss"] < run[1]["lm loss"] - 0.5
    for it in run:  # bf16 weights/activations with fp32 main params stay close to the fp32 curve
        assert abs(run[it]["lm loss"] - baseline[it]["lm loss"]) < BF16_VS_FP32, it
    assert all(v["skipped"] == 0 and v["nan"] == 0 for v in run.values())


@pytest.mark.parametrize("fmt,tp,pp,dp", [("hybrid", 1, 1, 1), ("e4m3", 1, 1, 1), ("hybrid", 2, 1, 1),
                                           ("hybrid", 1, 2, 1), ("hybrid", 1, 1, 2)],
                         ids=["hybrid", "e4m3", "hybrid-tp2-sp", "hybrid-pp2", "hybrid-dp2-distopt-overlap"])
def test_fp8_trains_and_tracks_bf16(data_prefix, fmt, tp, pp, dp):
    bf16 = losses(gpt_args(data_prefix, bf16=True))  # single-process bf16 reference
    extra = {"sequence_parallel": True} if tp > 1 else {}
    if dp > 1:  # the FP8 weight gradients go into main_grad, which the buckets reduce-scatter as they fill
        extra.update(use_distributed_optimizer=True, overlap_grad_reduce=True, ddp_bucket_size=20000)
    run = losses(gpt_args(data_prefix, tp=tp, bf16=True, fp8_format=fmt, pipeline_model_parallel_size=pp, **extra),
                 nproc=tp * pp * dp)
    assert run[10]["lm loss"] < run[1]["lm loss"] - 0.5
    for it in run:  # FP8 GEMMs (3 or 2 mantissa bits) on top of bf16 stay close to the bf16 curve
        assert abs(run[it]["lm loss"] - bf16[it]["lm loss"]) < FP8_VS_BF16, it
    assert all(v["skipped"] == 0 and v["nan"] == 0 for v in run.values())


@pytest.mark.parametrize("history,algo,tp,pp", [(1, "most_recent", 1, 1), (4, "max", 1, 2), (1, "most_recent", 2, 1)],
                         ids=["most-recent", "max-of-4-pp2", "most-recent-tp2-sp"])
def test_fp8_delayed_scaling_trains_and_tracks_bf16(data_prefix, history, algo, tp, pp):
    bf16 = losses(gpt_args(data_prefix, bf16=True))
    run = losses(gpt_args(data_prefix, tp=tp, bf16=True, fp8_format="hybrid", fp8_recipe="delayed",
                          fp8_amax_history_len=history, fp8_amax_compute_algo=algo, sequence_parallel=tp > 1,
                          pipeline_model_parallel_size=pp), nproc=tp * pp)
    assert run[10]["lm loss"] < run[1]["lm loss"] - 0.5
    for it in run:
        assert abs(run[it]["lm loss"] - bf16[it]["lm loss"]) < FP8_VS_BF16, it
    assert all(v["skipped"] == 0 and v["nan"] == 0 for v in run.values())


def test_fp16_dynamic_loss_scale_skips_overflows_then_trains(data_prefix):
    run = losses(gpt_args(data_prefix, fp16=True, initial_loss_scale=2.0**40, hysteresis=1, train_iters=40,
                          lr_decay_style="constant", lr_warmup_iters=0))
    scales = [run[i]["loss scale"] for i in sorted(run)]
    skipped = [run[i]["skipped"] for i in sorted(run)]
    # each overflow skips the step and halves the scale (hysteresis 1) until the gradients fit in fp16
    first_ok = next(i for i in range(1, len(skipped)) if skipped[i] == skipped[i - 1])
    assert first_ok >= 2 and skipped[first_ok - 1] == first_ok
    for i in range(first_ok):
        assert scales[i] == 2.0**40 / 2 ** (i + 1)
    assert run[40]["lm loss"] < run[first_ok + 1]["lm loss"] - 0.3  # then it trains
    assert all(v["nan"] == 0 for v in run.values())  # overflow skips are not NaN iterations
