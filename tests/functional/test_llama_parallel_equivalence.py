"""End to end: pretrain_gpt.py with Megatron-LM's Llama flags (RoPE θ 500000 with Llama 3.1 scaling, RMSNorm,
SwiGLU, grouped-query attention, no biases, untied output layer, per-head query/key norms) under torchrun (gloo,
CPU, fp32, dropout 0): TP below and equal to the number of query groups, ± SP, PP with interleaving and DP with the
distributed optimizer give the single-process `lm loss` and grad norm at every iteration to 5 digits."""

import pytest

from tests.functional.harness import assert_same_losses, gpt_args

LLAMA = {"num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4,
         "position_embedding_type": "rope", "rotary_base": 500000, "use_rope_scaling": True,
         "normalization": "RMSNorm", "norm_epsilon": 1e-5, "swiglu": True, "ffn_hidden_size": 96,
         "disable_bias_linear": True, "untie_embeddings_and_output_weights": True, "qk_layernorm": True}

LAYOUTS = {
    "baseline": (1, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),  # 2 query groups per rank
    "tp4": (4, {"tp": 4}),  # one query group per rank
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "tp2-dp2-distopt": (4, {"tp": 2, "use_distributed_optimizer": True}),
}


@pytest.fixture(scope="module")
def runs(data_prefix, run_cache):
    return run_cache.losses({f"llama-{name}": (nproc, gpt_args(data_prefix, **LLAMA, **flags))
                             for name, (nproc, flags) in LAYOUTS.items()})


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "baseline"])
def test_llama_layouts_match_one_process(runs, layout):
    assert_same_losses(runs["llama-baseline"], runs[f"llama-{layout}"], keys=("lm loss", "grad norm"))
