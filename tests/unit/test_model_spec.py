"""The one model description (megatron/core/model_spec.py) and its counts (model_counts.py): validation, the
flags that build it, Megatron-LM args and Hugging Face configs in and out, the copy stored in our checkpoints, and
parameter and FLOP counts against built models (ours and transformers', an independent count)."""

import dataclasses
import os
import sys

import pytest
import torch

from megatron.core import model_counts
from megatron.core.checkpoint_formats import CheckpointFormatError, read_our_checkpoint, spec_from_saved
from megatron.core.checkpoint_formats.hf_llama import hf_llama_config, spec_from_hf_llama_config
from megatron.core.checkpoint_formats.megatron_lm import megatron_args
from megatron.core.model_spec import ModelSpec, spec_from_args, spec_to_args
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig
from megatron.training.arguments import parse_config
from megatron.training.config import transformer_config
from megatron.training.plan_inputs import model_shape, parse_planner_argv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Megatron-LM's Llama-3 model flags (its Llama-3 example script), verbatim
LLAMA3_BLOCK = ("--position-embedding-type rope --rotary-base 500000 --use-rope-scaling --normalization RMSNorm "
                "--norm-epsilon 1e-5 --swiglu --ffn-hidden-size 8192 --group-query-attention --num-query-groups 8 "
                "--disable-bias-linear --untie-embeddings-and-output-weights").split()
# Llama-3.2-1B's sizes, and what a pretrain_gpt.py run adds
LLAMA_1B = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --seq-length 8192 "
            "--max-position-embeddings 131072 --rope-scaling-factor 32").split()
RUN = "--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 3e-4 --bf16 --mock-data".split()

LLAMA_SPEC = ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                       ffn_hidden_size=8192, seq_length=8192, max_position_embeddings=131072, padded_vocab_size=128256,
                       normalization="RMSNorm", layernorm_epsilon=1e-5, position_embedding_type="rope",
                       rotary_base=500000, use_rope_scaling=True, rope_scaling_factor=32.0, gated_linear_unit=True,
                       activation="silu", add_bias_linear=False, share_embeddings_and_output_weights=False)
SMALL_LLAMA = dataclasses.replace(LLAMA_SPEC, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                  kv_channels=16, ffn_hidden_size=160, seq_length=64, max_position_embeddings=16384,
                                  padded_vocab_size=256)
QWEN2_SPEC = dataclasses.replace(SMALL_LLAMA, use_rope_scaling=False, rope_scaling_factor=8.0, add_qkv_bias=True,
                                 share_embeddings_and_output_weights=True, layernorm_epsilon=1e-6,
                                 rotary_base=1000000)
GPT2_SPEC = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=256)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_query_groups=3), "--num-attention-heads (4) must be a multiple of --num-query-groups (3)"),
    (dict(hidden_size=66), "--hidden-size (66) must be divisible by --num-attention-heads (4), or give --kv-channels"),
    (dict(normalization="BatchNorm"), "--normalization must be one of LayerNorm, RMSNorm"),
    (dict(position_embedding_type="alibi"), "--position-embedding-type must be one of"),
    (dict(rotary_percent=0.5), "--rotary-percent needs --position-embedding-type rope"),
    (dict(use_rope_scaling=True), "--use-rope-scaling needs --position-embedding-type rope"),
    (dict(position_embedding_type="rope", kv_channels=6, rotary_percent=0.5), "3 rotated channels per head"),
    (dict(position_embedding_type="rope", rotary_percent=0.0), "--rotary-percent must be in (0, 1]"),
    (dict(activation="relu"), "activation must be one of gelu, silu"),
    (dict(seq_length=64, max_position_embeddings=32), "--seq-length (64) exceeds --max-position-embeddings (32)"),
    (dict(layernorm_epsilon=0.0), "--norm-epsilon must be above 0"),
    (dict(num_layers=0), "--num-layers must be an integer >= 1"),
])
def test_invalid_specs_are_refused_in_one_line_naming_the_flag(kwargs, needle):
    with pytest.raises(ValueError) as err:
        ModelSpec(**{**dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32), **kwargs})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_derived_sizes_are_filled_and_rope_may_exceed_the_position_table():
    s = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32)
    assert (s.num_query_groups, s.kv_channels, s.ffn_hidden_size, s.max_position_embeddings) == (4, 16, 256, 32)
    assert ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=32,
                     position_embedding_type="rope").seq_length == 64
    with pytest.raises(ValueError, match="--num-query-groups \\(2\\) must be divisible by "
                                         "--tensor-model-parallel-size \\(4\\)"):
        SMALL_LLAMA.check_tensor_parallel(4)
    SMALL_LLAMA.check_tensor_parallel(2)


def test_transformer_config_is_the_spec_plus_runtime_switches():
    cfg = TransformerConfig.from_spec(GPT2_SPEC, hidden_dropout=0.0, sequence_parallel=True)
    assert isinstance(cfg, ModelSpec) and cfg.spec == GPT2_SPEC and type(cfg.spec) is ModelSpec
    assert cfg.hidden_dropout == 0.0 and cfg.kv_channels == 16
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(GPT2_SPEC.to_dict()) < fields  # each spec field declared once, in ModelSpec
    with pytest.raises(ValueError, match="--seq-length \\(18\\) must be divisible by --tensor-model-parallel-size"):
        dataclasses.replace(cfg, seq_length=18, max_position_embeddings=18).check_tensor_parallel(4)


def test_the_llama3_flag_block_parses_into_the_llama_spec():
    cfg, notes = parse_config(LLAMA_1B + LLAMA3_BLOCK + RUN)
    assert not notes
    assert cfg.model.spec(128256) == LLAMA_SPEC
    # --swiglu without --ffn-hidden-size: Megatron-LM's 2/3 x 4h rounded down to a multiple of 64
    cfg, _ = parse_config(LLAMA_1B + [f for f in LLAMA3_BLOCK if f not in ("--ffn-hidden-size", "8192")] + RUN)
    assert cfg.model.spec(128256).ffn_hidden_size == 5440
    # the trainer's transformer configuration is that spec plus the runtime switches
    assert transformer_config(cfg.model, cfg.precision, False, 128256).spec == cfg.model.spec(128256)
    # --multi-query-attention is Megatron-LM's older spelling of one query group
    cfg, notes = parse_config(LLAMA_1B[:8] + ["--multi-query-attention"] + RUN)
    assert cfg.model.spec(128).num_query_groups == 1 and "older spelling" in notes[0]


@pytest.mark.parametrize("spec", [GPT2_SPEC, LLAMA_SPEC, QWEN2_SPEC,
                                  dataclasses.replace(GPT2_SPEC, position_embedding_type="rope", rotary_percent=0.5,
                                                      rotary_interleaved=True, rotary_seq_len_interpolation_factor=2.0,
                                                      qk_layernorm=True, kv_channels=8,
                                                      layernorm_zero_centered_gamma=True)])
def test_megatron_args_round_trip(spec):
    args = spec_to_args(spec)
    assert spec_from_args(args) == spec
    assert args["swiglu"] == spec.swiglu and args["group_query_attention"] == (spec.num_query_groups != 4 and
                                                                               spec.num_query_groups != 32)


def test_megatron_lm_args_are_written_from_the_spec():
    from megatron.core.checkpoint_formats import dims_from_args

    args = dict(spec_to_args(LLAMA_SPEC), params_dtype="bfloat16")
    dims = dims_from_args(args)
    ns = megatron_args(args, dims, tp=2, pp=1, consumed=0, iteration=1)
    assert (ns.swiglu, ns.normalization, ns.num_query_groups, ns.group_query_attention) == (True, "RMSNorm", 8, True)
    assert (ns.position_embedding_type, ns.rotary_base, ns.add_bias_linear, ns.use_rope_scaling) == \
        ("rope", 500000, False, True)
    assert ns.untie_embeddings_and_output_weights and ns.kv_channels == 64 and ns.norm_epsilon == 1e-5
    assert spec_from_args(vars(ns)) == LLAMA_SPEC


def _hf_config(cls, d):
    return cls(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})


def test_hugging_face_llama_qwen2_mistral_configs_round_trip():
    import transformers

    same_seq = lambda s: dataclasses.replace(s, seq_length=s.max_position_embeddings)  # noqa: E731
    cfg = _hf_config(transformers.LlamaConfig, hf_llama_config(SMALL_LLAMA))
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 32.0
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.num_key_value_heads == 2 and cfg.head_dim == 16
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.mlp_bias
    assert spec_from_hf_llama_config(cfg.to_dict()) == same_seq(SMALL_LLAMA)
    # a transformers-4 style config.json (rope_theta and rope_scaling at the top level) reads the same
    assert spec_from_hf_llama_config(hf_llama_config(SMALL_LLAMA)) == same_seq(SMALL_LLAMA)
    qwen = hf_llama_config(QWEN2_SPEC)
    assert qwen["model_type"] == "qwen2"
    assert spec_from_hf_llama_config(_hf_config(transformers.Qwen2Config, qwen).to_dict()) == same_seq(QWEN2_SPEC)
    mistral_spec = dataclasses.replace(SMALL_LLAMA, use_rope_scaling=False, rope_scaling_factor=8.0)
    mistral = _hf_config(transformers.MistralConfig, hf_llama_config(mistral_spec, model_type="mistral"))
    assert spec_from_hf_llama_config(mistral.to_dict()) == same_seq(mistral_spec)


@pytest.mark.parametrize("change,needle", [
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}), "low_freq_factor 2.0 differs"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias True with mlp_bias False"),
    (dict(model_type="mistral", sliding_window=4096), "sliding_window 4096 is not supported"),
])
def test_hugging_face_configs_the_spec_cannot_describe_are_refused(change, needle):
    with pytest.raises(CheckpointFormatError, match=needle):
        spec_from_hf_llama_config({**hf_llama_config(SMALL_LLAMA), **change})
    with pytest.raises(CheckpointFormatError, match="needs --normalization RMSNorm"):
        hf_llama_config(GPT2_SPEC)


def test_parameter_count_is_an_independent_count_of_the_same_llama_and_qwen2():
    import transformers

    for spec, cls in ((SMALL_LLAMA, transformers.LlamaForCausalLM), (QWEN2_SPEC, transformers.Qwen2ForCausalLM)):
        config_cls = transformers.LlamaConfig if cls is transformers.LlamaForCausalLM else transformers.Qwen2Config
        hf = cls(_hf_config(config_cls, hf_llama_config(spec)))
        assert model_counts.num_parameters(spec) == hf.num_parameters(), cls.__name__
        # per TP rank: what is split shrinks by TP, what is replicated (norms, the row-parallel output biases) not
        per_rank = model_counts.chunk_param_numels(spec, 2, spec.num_layers, True, True)
        assert sum(per_rank) == (hf.num_parameters() - _replicated(spec)) // 2 + _replicated(spec)


def _replicated(spec):
    """Parameters every TP rank holds whole: RMSNorm weights (two per layer and the final one)."""
    return (2 * spec.num_layers + 1) * spec.hidden_size


@pytest.mark.parametrize("untied", [False, True])
def test_parameter_count_equals_the_built_gpt_and_bert(untied):
    from megatron.core.models.bert import BertModel
    from megatron.core.models.gpt import GPTModel

    spec = dataclasses.replace(GPT2_SPEC, share_embeddings_and_output_weights=not untied, ffn_hidden_size=96)
    gpt = GPTModel(TransformerConfig.from_spec(spec), ParallelState.single())
    assert model_counts.num_parameters(spec) == sum(p.numel() for p in gpt.parameters())
    bert_spec = dataclasses.replace(spec, attention_mask_type="padding")
    for binary in (True, False):
        bert = BertModel(TransformerConfig.from_spec(bert_spec), ParallelState.single(),
                         num_tokentypes=2 if binary else 0, add_binary_head=binary)
        assert model_counts.num_parameters(bert_spec, "bert", 2 if binary else 0, binary) == \
            sum(p.numel() for p in bert.parameters())


def test_flops_per_token_by_hand():
    # GQA (4 heads of 16 channels, 2 groups), SwiGLU (ffn 160), s = 64, V = 256, 2 layers
    s, h, d, heads, groups, f, V, L = 64, 64, 16, 4, 2, 160, 256, 2
    qkv = 2 * h * (heads * d + 2 * groups * d)  # 2 FLOPs per multiply-add: 64 x (64 + 64) x 2
    scores = 2 * s * heads * d * 2  # QK^T and the weighted sum, every position
    proj = 2 * heads * d * h
    mlp = 2 * h * (2 * f) + 2 * f * h  # [gate; up] and down: three ffn-sized GEMMs
    forward = L * (qkv + scores + proj + mlp) + 2 * h * V
    assert (qkv, scores, proj, mlp) == (16384, 16384, 8192, 61440)
    assert model_counts.forward_flops_per_token(SMALL_LLAMA) == forward
    assert model_counts.num_floating_point_operations(SMALL_LLAMA, 8) == 3 * forward * 8 * s
    # the GeLU MLP with ffn = 4h and one group per head: Megatron's 72 L h^2 + 12 L h s + 6 h V per token
    g = GPT2_SPEC
    assert model_counts.flops_per_token(g) == 72 * 2 * 64 ** 2 + 12 * 2 * 64 * 32 + 6 * 64 * 256


def test_the_planner_reads_a_pretrain_gpt_command_line_with_the_trainers_parser():
    argv = LLAMA_1B + LLAMA3_BLOCK + RUN + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128000",
                                             "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                             "--checkpoint-activations"]
    ns = parse_planner_argv(argv)
    shape = model_shape(ns)
    cfg, _ = parse_config(argv, world_size=2)
    assert shape.spec_at(2) == cfg.model.spec(shape.padded_vocab(2))
    assert shape.padded_vocab(2) == 128256 and (ns.recompute_granularity, ns.recompute_method) == ("full", "uniform")
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        parse_planner_argv(argv + ["--no-such-flag"])


def test_our_checkpoint_stores_the_spec_and_inference_builds_from_it(tmp_path):
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    from megatron.core.inference import load_gpt_for_inference
    from megatron.training.checkpointing import read_saved_args

    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
            "--train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 100 --eval-iters 0 "
            f"--num-workers 0 --untie-embeddings-and-output-weights --norm-epsilon 1e-6 --save {tmp_path}").split()
    pretrain_gpt.main(argv)
    cfg, _ = parse_config(argv)
    want = cfg.model.spec(128)
    path = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    assert state["model_spec"] == want.to_dict()
    ckpt = read_our_checkpoint(str(tmp_path))
    assert spec_from_saved(ckpt.args_dict) == want
    assert read_saved_args(str(tmp_path))["norm_epsilon"] == 1e-6  # --use-checkpoint-args reads it back
    assert load_gpt_for_inference(str(tmp_path)).model.config.spec == want
    # an older checkpoint without the stored spec: the model its stored flags describe
    del state["model_spec"]
    torch.save(state, path)
    assert load_gpt_for_inference(str(tmp_path)).model.config.spec == want


def test_the_llama_example_script_plans_its_run(tmp_path):
    """examples/pretrain_llama.sh with DRY_RUN=1: the real entry point validates its flags (Megatron-LM's Llama-3
    block) and the planner counts the model it describes exactly."""
    import subprocess

    from megatron.core.tokenizer import build_tokenizer

    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(ROOT, "data/gpt2-vocab.json"),
                           merge_file=os.path.join(ROOT, "data/gpt2-merges.txt"))
    gpt2._tok.save(str(tmp_path / "tokenizer.json"))
    env = dict(os.environ, DRY_RUN="1", DATA=str(tmp_path / "no_such_prefix"), CKPT=str(tmp_path / "ckpt"),
               TOKENIZER=str(tmp_path / "tokenizer.json"), PYTHONPATH=ROOT)
    proc = subprocess.run(["bash", "examples/pretrain_llama.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    want = model_counts.num_parameters(dataclasses.replace(LLAMA_SPEC, padded_vocab_size=50304))
    assert f"parameters per (tensor, pipeline) rank: stage 0: {want:,}" in proc.stdout
    assert "TP1 PP1 DP8 distopt" in proc.stdout and not (tmp_path / "ckpt").exists()


def test_hugging_face_gpt2_and_bert_configs_round_trip():
    import transformers

    from megatron.core.checkpoint_formats.hf_bert import hf_bert_config, spec_from_hf_bert_config
    from megatron.core.checkpoint_formats.hf_gpt2 import hf_gpt2_config, spec_from_hf_gpt2_config

    gpt2 = dataclasses.replace(GPT2_SPEC, share_embeddings_and_output_weights=True, seq_length=64,
                               max_position_embeddings=64, layernorm_epsilon=1e-5)
    cfg = _hf_config(transformers.GPT2Config, hf_gpt2_config(gpt2, 250, eod=249))
    assert spec_from_hf_gpt2_config(cfg.to_dict()) == gpt2  # 250 rows padded to 256 at TP 1
    # GPT2LMHeadModel counts the same parameters (its vocabulary: the 256 padded rows)
    hf = transformers.GPT2LMHeadModel(_hf_config(transformers.GPT2Config, hf_gpt2_config(gpt2, None, eod=0)))
    assert hf.num_parameters() == model_counts.num_parameters(gpt2)
    for post_ln in (True, False):
        bert = dataclasses.replace(gpt2, attention_mask_type="padding", layernorm_epsilon=1e-12,
                                   apply_residual_connection_post_layernorm=post_ln)
        d = hf_bert_config(bert, 250, binary_head=True)
        cls = transformers.BertConfig if post_ln else transformers.MegatronBertConfig
        assert spec_from_hf_bert_config({**_hf_config(cls, d).to_dict(), "model_type": d["model_type"]}) == bert
    with pytest.raises(CheckpointFormatError, match="GPT2LMHeadModel cannot hold normalization = RMSNorm"):
        hf_gpt2_config(dataclasses.replace(gpt2, normalization="RMSNorm"), None, None)


def test_field_names_and_defaults_are_megatron_cores():
    """Golden file from Megatron-Core 0.16.1's own classes (generator next to it): every spec field that
    Megatron-Core's ``TransformerConfig`` or ``GPTModel`` holds has that name and default there; the spec's required
    sizes and its tied-output default (Megatron-LM's flag default; ``GPTModel``'s argument defaults to untied) aside."""
    import json

    with open(os.path.join(ROOT, "tests/unit/model_spec_golden/mcore_spec_names.json")) as f:
        golden = json.load(f)["fields"]
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    assert list(golden) == list(defaults)  # the golden file covers every field (regenerate it when one is added)
    held = {n: g for n, g in golden.items() if g is not None}
    assert len(held) >= 20
    differ = {n for n, g in held.items() if g["default"] != defaults[n]}
    assert differ == {"num_layers", "hidden_size", "num_attention_heads", "share_embeddings_and_output_weights"}
