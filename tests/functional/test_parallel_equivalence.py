"""End to end: pretrain_gpt.py under torchrun (gloo, CPU, fp32, dropout 0) gives the single-process losses.

Each layout trains the same tiny GPT on the same data with the same global batch for 10 iterations; the
`lm loss` and grad norm printed at every iteration must agree to 5 significant digits.
The layouts of one world size are trained one after another in one torchrun (tests/functional/run_many.py), each
from scratch through pretrain_gpt.py's ``main``; every layout is still its own test.
"""

import pytest

from tests.functional.harness import assert_same_losses, gpt_args

# name: (processes, flags); "tp" also sets --make-vocab-size-divisible-by so the padded vocabulary stays the same
LAYOUTS = {
    "baseline": (1, {}),
    "tp2": (2, {"tp": 2}),
    "tp4": (4, {"tp": 4}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "tp4-sp": (4, {"tp": 4, "sequence_parallel": True}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "pp4": (4, {"pipeline_model_parallel_size": 4}),
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    # --decoder-first-pipeline-num-layers 1: stage 0 holds 1 layer, stage 1 the other 3
    "pp2-uneven": (2, {"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 1}),
    "dp2": (2, {}),
    "dp4-distopt": (4, {"use_distributed_optimizer": True}),
    "dp2-distopt-overlap-param-gather": (2, {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                             "ddp_bucket_size": 20000, "overlap_param_gather": True}),
    "dp4-overlap-small-buckets": (4, {"overlap_grad_reduce": True, "ddp_bucket_size": 5000}),
    "tp2-dp2-distopt": (4, {"tp": 2, "use_distributed_optimizer": True}),
    "pp2-dp2-distopt-overlap": (4, {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True,
                                    "overlap_grad_reduce": True}),
    "tp2-pp2-dp2-sp-distopt": (8, {"tp": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True,
                                   "use_distributed_optimizer": True}),
    # one microbatch of 8 (or 2 of 4) gives the update of the baseline's 4 accumulated microbatches of 2
    "micro-batch-8": (1, {"micro_batch_size": 8}),
    "micro-batch-4": (1, {"micro_batch_size": 4}),
    # --use-torch-compile (Inductor on CPU) computes the same model
    "torch-compile": (1, {"use_torch_compile": True}),
}


@pytest.fixture(scope="module")
def runs(data_prefix, run_cache):
    return run_cache.losses({name: (nproc, gpt_args(data_prefix, **flags)) for name, (nproc, flags) in LAYOUTS.items()})


@pytest.mark.parametrize("layout", ["tp2", "tp4", "tp2-sp", "tp4-sp"])
def test_tensor_and_sequence_parallel(runs, layout):
    assert_same_losses(runs["baseline"], runs[layout], keys=("lm loss", "grad norm"))


@pytest.mark.parametrize("layout", ["pp2", "pp4", "pp2-vpp2", "pp2-uneven"])
def test_pipeline_parallel(runs, layout):
    assert_same_losses(runs["baseline"], runs[layout], keys=("lm loss", "grad norm"))


@pytest.mark.parametrize("layout", ["dp2", "dp4-distopt", "dp2-distopt-overlap-param-gather",
                                    "dp4-overlap-small-buckets", "tp2-dp2-distopt", "pp2-dp2-distopt-overlap"])
def test_data_parallel(runs, layout):
    assert_same_losses(runs["baseline"], runs[layout], keys=("lm loss", "grad norm"))


def test_3d_tp2_pp2_dp2_sequence_parallel(runs):
    assert_same_losses(runs["baseline"], runs["tp2-pp2-dp2-sp-distopt"], keys=("lm loss", "grad norm"))


@pytest.mark.parametrize("layout", ["micro-batch-8", "micro-batch-4"])
def test_gradient_accumulation(runs, layout):
    assert_same_losses(runs["baseline"], runs[layout], keys=("lm loss", "grad norm"))


def test_torch_compile_matches_eager(runs):
    assert_same_losses(runs["baseline"], runs["torch-compile"], keys=("lm loss", "grad norm"))
