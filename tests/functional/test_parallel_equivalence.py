"""End to end: pretrain_gpt.py under torchrun (gloo, CPU, fp32, dropout 0) gives the single-process losses.

Each layout trains the same tiny GPT on the same data with the same global batch for 10 iterations; the
`lm loss` printed at every iteration must agree to 5 significant digits (and the grad norm too for DP).
"""

import pytest

from tests.functional.harness import assert_same_losses, gpt_args, losses


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (2, True), (4, True)])
def test_tensor_and_sequence_parallel(data_prefix, baseline, tp, sp):
    run = losses(gpt_args(data_prefix, tp=tp, sequence_parallel=sp), nproc=tp)
    assert_same_losses(baseline, run, keys=("lm loss", "grad norm"))


@pytest.mark.parametrize("pp,vpp", [(2, None), (4, None), (2, 2)])
def test_pipeline_parallel(data_prefix, baseline, pp, vpp):
    run = losses(gpt_args(data_prefix, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vpp), nproc=pp)
    assert_same_losses(baseline, run, keys=("lm loss", "grad norm"))


@pytest.mark.parametrize("nproc,extra", [
    (2, {}),
    (4, {"use_distributed_optimizer": True}),
    (2, {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 20000,
         "overlap_param_gather": True}),
    (4, {"overlap_grad_reduce": True, "ddp_bucket_size": 5000}),
    (4, {"tensor_model_parallel_size": 2, "use_distributed_optimizer": True}),
    (4, {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True, "overlap_grad_reduce": True}),
])
def test_data_parallel(data_prefix, baseline, nproc, extra):
    tp = extra.pop("tensor_model_parallel_size", 1)
    run = losses(gpt_args(data_prefix, tp=tp, tensor_model_parallel_size=tp, **extra), nproc=nproc)
    assert_same_losses(baseline, run, keys=("lm loss", "grad norm"))


def test_3d_tp2_pp2_dp2_sequence_parallel(data_prefix, baseline):
    run = losses(gpt_args(data_prefix, tp=2, pipeline_model_parallel_size=2, sequence_parallel=True,
                          use_distributed_optimizer=True), nproc=8)
    assert_same_losses(baseline, run, keys=("lm loss", "grad norm"))


@pytest.mark.parametrize("micro", [8, 4])
def test_gradient_accumulation(data_prefix, baseline, micro):
    """One microbatch of 8 (or 2 of 4) gives the update of the baseline's 4 accumulated microbatches of 2."""
    run = losses(gpt_args(data_prefix, micro_batch_size=micro))
    assert_same_losses(baseline, run, keys=("lm loss", "grad norm"))


def test_uneven_pipeline_split(data_prefix, baseline):
    """--decoder-first-pipeline-num-layers 1: stage 0 holds 1 layer, stage 1 the other 3."""
    run = losses(gpt_args(data_prefix, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1), nproc=2)
    assert_same_losses(baseline, run, keys=("lm loss", "grad norm"))


def test_torch_compile_matches_eager(data_prefix, baseline):
    """--use-torch-compile (Inductor on CPU) computes the same model."""
    run = losses(gpt_args(data_prefix, use_torch_compile=True), timeout=900)
    assert_same_losses(baseline, run, keys=("lm loss", "grad norm"))
