"""End to end: pretrain_gpt.py with Megatron-LM's Llama flags (RoPE θ 500000 with Llama 3.1 scaling, RMSNorm,
SwiGLU, grouped-query attention, no biases, untied output layer, per-head query/key norms) under torchrun (gloo,
CPU, fp32, dropout 0): TP below and equal to the number of query groups, ± SP, PP with interleaving, PP 4, DP with the
distributed optimizer (TP2×PP2×DP2 with SP) give the single-process `lm loss` and grad norm at every iteration to 5
digits; selective and full recomputation give them exactly; bf16 and fp16 (fp32 main parameters) track them."""

import pytest

from tests.functional.harness import assert_same_losses, gpt_args
from tests.functional.test_mixed_precision import BF16_REL

LLAMA = {"num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4,
         "position_embedding_type": "rope", "rotary_base": 500000, "use_rope_scaling": True,
         "normalization": "RMSNorm", "norm_epsilon": 1e-5, "swiglu": True, "ffn_hidden_size": 96,
         "disable_bias_linear": True, "untie_embeddings_and_output_weights": True, "qk_layernorm": True}
ITERS = 6

LAYOUTS = {
    "baseline": (1, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),  # 2 query groups per rank
    "tp4": (4, {"tp": 4}),  # one query group per rank
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "pp4": (4, {"pipeline_model_parallel_size": 4}),  # one layer per stage; the untied output on the last
    "tp2-pp2-dp2-sp-distopt": (8, {"tp": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True,
                                   "use_distributed_optimizer": True}),
}
RECOMPUTE = {
    "recompute-selective": {"recompute_granularity": "selective"},
    "recompute-full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "recompute-full-block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
}
PRECISION = {"bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 4096}}
FP16_REL = 5e-5  # measured: 5e-6 (bf16: 2e-5 against BF16_REL 3e-4); fp16 keeps 3 more mantissa bits than bf16


@pytest.fixture(scope="module")
def runs(data_prefix, run_cache):
    jobs = {name: (nproc, flags) for name, (nproc, flags) in LAYOUTS.items()}
    jobs.update({name: (1, flags) for name, flags in {**RECOMPUTE, **PRECISION}.items()})
    return run_cache.losses({f"llama-{name}": (nproc, gpt_args(data_prefix, train_iters=ITERS, **LLAMA, **flags))
                             for name, (nproc, flags) in jobs.items()})


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "baseline"])
def test_llama_layouts_match_one_process(runs, layout):
    assert_same_losses(runs["llama-baseline"], runs[f"llama-{layout}"], keys=("lm loss", "grad norm"))


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_llama_recomputation_is_exact(runs, recompute):
    assert_same_losses(runs["llama-baseline"], runs[f"llama-{recompute}"], rel=0.0, keys=("lm loss", "grad norm"))


@pytest.mark.parametrize("precision", list(PRECISION))
def test_llama_mixed_precision_tracks_fp32(runs, precision):
    run = runs[f"llama-{precision}"]
    assert all(v["skipped"] == 0 and v["nan"] == 0 for v in run.values())
    assert run[ITERS]["lm loss"] < run[1]["lm loss"] - 0.3
    assert_same_losses(runs["llama-baseline"], run, rel=BF16_REL if precision == "bf16" else FP16_REL)
