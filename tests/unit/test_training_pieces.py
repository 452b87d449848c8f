"""LR schedule, flag validation, vocab padding, FLOP count and the iteration log line."""

import math
import re

import pytest
import torch

from megatron.training.arguments import ConfigError, pad_vocab_size, parse_config
from megatron.core.model_counts import num_floating_point_operations
from megatron.training.logging import format_eval_line, format_iteration_line
from megatron.training.scheduler import OptimizerParamScheduler


class _Opt:
    def __init__(self):
        self.param_groups = [{"lr_mult": 1.0, "wd_mult": 1.0}, {"lr_mult": 1.0, "wd_mult": 0.0}]


def _lrs(style, steps, warmup=10, decay=100, max_lr=1.0, min_lr=0.1):
    opt = _Opt()
    sched = OptimizerParamScheduler(opt, max_lr, min_lr, warmup, decay, style, weight_decay=0.1)
    out = {0: opt.param_groups[0]["lr"]}
    for n in range(1, max(steps) + 1):
        sched.step(1)
        out[n] = opt.param_groups[0]["lr"]
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[0]["weight_decay"] == 0.1
    return [out[s] for s in steps]


def test_lr_schedules_hand_computed():
    # warm-up: linear from 0 to max over 10 steps
    assert _lrs("linear", [0, 5, 10]) == pytest.approx([0.0, 0.5, 1.0])
    # linear decay over steps 10..100 to min_lr 0.1: halfway (55) = 0.1 + 0.5 * 0.9
    assert _lrs("linear", [55, 100, 150]) == pytest.approx([0.55, 0.1, 0.1])
    # cosine: at 55 ratio 0.5 -> coeff 0.5; at 32.5 ratio 0.25 -> coeff (cos(pi/4)+1)/2
    c = 0.5 * (math.cos(math.pi * 0.25) + 1)
    assert _lrs("cosine", [55, 100]) == pytest.approx([0.55, 0.1])
    opt = _Opt()
    sched = OptimizerParamScheduler(opt, 1.0, 0.1, 10, 90, "cosine", 0.0)
    sched.step(30)  # ratio (30-10)/80 = 0.25
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 + c * 0.9)
    assert _lrs("constant", [5, 50, 500]) == pytest.approx([0.5, 1.0, 1.0])


def test_scheduler_state_round_trip():
    opt1, opt2 = _Opt(), _Opt()
    s1 = OptimizerParamScheduler(opt1, 1.0, 0.0, 5, 50, "cosine", 0.0)
    s1.step(17)
    s2 = OptimizerParamScheduler(opt2, 1.0, 0.0, 5, 50, "cosine", 0.0)
    s2.load_state_dict(s1.state_dict())
    assert opt2.param_groups[0]["lr"] == opt1.param_groups[0]["lr"] and s2.num_steps == 17


def test_scheduler_group_lrs_look_ahead_without_stepping():
    """What the CUDA-graph trainer hands the graph for a step launched ahead: each group's learning rate after
    one more successful step (and now), without moving the schedule."""
    opt = _Opt()
    opt.param_groups[1]["lr_mult"] = 0.5
    sched = OptimizerParamScheduler(opt, 1.0, 0.1, 4, 20, "cosine", 0.0)
    for _ in range(6):
        now, ahead = sched.group_lrs(0), sched.group_lrs(1)
        assert now == [g["lr"] for g in opt.param_groups]
        before = sched.num_steps
        sched.step(1)
        assert sched.num_steps == before + 1 and ahead == [g["lr"] for g in opt.param_groups]
        assert ahead[1] == 0.5 * ahead[0] and ahead != now


def test_vocab_padding_follows_megatron():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 2) == 50432
    assert pad_vocab_size(50257, 256, 2) == 50688 == pad_vocab_size(50257, 512, 1) == pad_vocab_size(50257, 128, 4)
    assert pad_vocab_size(512, 128, 4) == 512


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--data-path", "x"]


def parse_args(argv, world_size=1):
    return parse_config(argv, world_size=world_size)[0]


def _err(capsys, argv, world=1):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + argv, world_size=world)
    assert "\n" not in str(err.value) and "usage:" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("argv,world,needle", [
    (["--global-batch-size", "7"], 2, "--global-batch-size (7) must be a multiple of --micro-batch-size (2)"),
    (["--tensor-model-parallel-size", "3"], 6, "--num-attention-heads (4) must be divisible by"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers (2) must be divisible by --pipeline-model-parallel-size"),
    (["--bf16", "--fp16"], 1, "only one of --bf16 and --fp16"),
    (["--train-samples", "100"], 1, "exactly one of --train-iters and --train-samples"),
    (["--lr-decay-style", "step"], 1, "--lr-decay-style"),
    (["--hidden-dropout", "1.5"], 1, "--hidden-dropout must be in [0, 1)"),
    (["--recompute-granularity", "full"], 1, "--recompute-method"),
    (["--num-experts", "8"], 1, "--num-experts is a Megatron-LM flag for mixture of experts"),
    (["--position-embedding-type", "alibi"], 1, "argument --position-embedding-type: invalid choice: 'alibi'"),
    (["--group-query-attention", "--num-query-groups", "3"], 1,
     "--num-attention-heads (4) must be a multiple of --num-query-groups (3)"),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
     "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (4)"),
    (["--rotary-percent", "0.5"], 1, "--rotary-percent needs --position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], 1, "--rotary-percent must be in (0, 1]"),
    (["--no-such-flag"], 1, "unrecognized arguments: --no-such-flag"),
    (["--hiden-size", "8"], 1, "unrecognized arguments: --hiden-size 8 (did you mean --hidden-size"),
    (["--fp8-format", "hybrid"], 1, "--fp8-format needs --bf16"),
    (["--fp8-format", "hybrid", "--bf16", "--use-torch-compile"], 1, "does not combine with --use-torch-compile"),
    (["--fp8-format", "e4m3", "--bf16", "--seq-length", "20", "--max-position-embeddings", "20"], 1,
     "multiples of 16: --micro-batch-size x --seq-length = 40"),
    (["--fp8-recipe", "mxfp8"], 1, "argument --fp8-recipe: invalid choice: 'mxfp8'"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-amax-history-len", "1024"], 1, "need --fp8-recipe delayed"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "0"], 1,
     "--fp8-amax-history-len must be >= 1"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "4", "--seq-length", "18",
      "--max-position-embeddings", "18"], 4, "--seq-length (18) must be divisible"),
])
def test_bad_flags_are_named(capsys, argv, world, needle):
    assert needle in _err(capsys, argv, world)


def test_derived_values():
    a = parse_args(BASE + ["--global-batch-size", "16", "--lr-warmup-fraction", "0.2"], world_size=2)
    assert (a.parallel.data_parallel_size, a.training.num_microbatches, a.model.ffn_hidden_size) == (2, 4, 128)
    assert (a.scheduler.lr_decay_iters, a.scheduler.lr_warmup_iters, a.model.max_position_embeddings) == (10, 2, 16)
    b = parse_args([x for x in BASE if x not in ("--train-iters", "10")] + ["--train-samples", "40"], world_size=1)
    assert b.training.train_iters == 20


@pytest.mark.parametrize("flag,backend", [("auto", "sdpa"), ("flash", "flash"), ("fused", "cudnn"),
                                          ("unfused", "unfused"), ("local", "unfused")])
def test_attention_backend_flag_maps_to_a_kernel(flag, backend):
    assert parse_args(BASE + ["--attention-backend", flag]).model.attention_backend == backend
    assert parse_args(BASE + ["--attention-backend", flag, "--no-masked-softmax-fusion"]).model.attention_backend \
        == "unfused"


def test_fused_adamw_flag_reaches_the_optimizer_factory(monkeypatch):
    """--no-fused-adamw turns FusedAdamW off; the factory picks it only for 16-bit params on a device where the
    Triton kernel runs (so the CPU keeps torch's foreach AdamW either way)."""
    import megatron.core.optimizer.factory as factory
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.fused_adamw import FusedAdamW

    assert parse_args(BASE).optimizer.fused_adamw and not parse_args(BASE + ["--no-fused-adamw"]).optimizer.fused_adamw
    groups = lambda: [{"params": [torch.nn.Parameter(torch.zeros(4))]}]  # noqa: E731
    cpu = torch.device("cpu")
    assert not isinstance(factory.make_torch_optimizer(OptimizerConfig(bf16=True), groups(), cpu, True), FusedAdamW)
    monkeypatch.setattr(factory, "fused_adamw_available", lambda device: True)  # as on a CUDA machine
    assert isinstance(factory.make_torch_optimizer(OptimizerConfig(bf16=True), groups(), cpu, True), FusedAdamW)
    assert not isinstance(factory.make_torch_optimizer(OptimizerConfig(bf16=True), groups(), cpu, False), FusedAdamW)
    assert not isinstance(factory.make_torch_optimizer(OptimizerConfig(bf16=True, fused_adamw=False), groups(), cpu,
                                                       True), FusedAdamW)


def test_flops_formula_matches_megatron_per_token_count():
    model = parse_args(["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                        "--seq-length", "2048", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1",
                        "--data-path", "x"]).model
    per_token = 72 * 24 * 2048**2 + 12 * 24 * 2048 * 2048 + 6 * 2048 * 50304
    assert num_floating_point_operations(model.spec(50304), 8) == pytest.approx(per_token * 8 * 2048)


def test_iteration_line_has_megatron_fields():
    line = format_iteration_line(100, 1000, 12800, 123.45, 1.5e-4, 128, {"lm loss": 5.123456}, 1.0, 1.2345,
                                 0, 0, tflops_per_gpu=45.6, tokens_per_sec_per_gpu=1000.0)
    pattern = (r" iteration\s+100/\s+1000 \| consumed samples:\s+12800 \| elapsed time per iteration \(ms\): 123\.5 \|"
               r" throughput per GPU \(TFLOP/s/GPU\): 45\.6 \| tokens per second per GPU: 1000\.0 \|"
               r" learning rate: 1\.500000E-04 \| global batch size:\s+128 \| lm loss: 5\.123456E\+00 \|"
               r" loss scale: 1\.0 \| grad norm: 1\.234500 \| number of skipped iterations:\s+0 \|"
               r" number of nan iterations:\s+0 \|$")
    assert re.search(pattern, line), line
    ev = format_eval_line("validation loss at iteration 100", {"lm loss": 2.0})
    assert "lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 |" in ev


def test_cuda_graph_needs_a_gpu(capsys):
    if not torch.cuda.is_available():
        assert "--enable-cuda-graph needs a CUDA GPU" in _err(capsys, ["--enable-cuda-graph"])


@pytest.mark.parametrize("argv,world,needle", [
    ([], 2, "one GPU (world size 1), got world size 2"),
    (["--fp16"], 1, "needs --bf16 or fp32"),
    (["--attention-dropout", "0.1"], 1, "needs --attention-dropout 0"),
    (["--recompute-granularity", "selective"], 1, "--recompute-modules mlp_act"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], 1, "--recompute-modules mlp_act"),
    (["--optimizer", "sgd"], 1, "needs --optimizer adam"),
    (["--cuda-graph-warmup-steps", "0"], 1, "--cuda-graph-warmup-steps must be >= 1"),
])
def test_cuda_graph_rejects_what_it_cannot_capture(capsys, monkeypatch, argv, world, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--enable-cuda-graph", "--attention-dropout", "0"] + argv if "--attention-dropout" not in argv else \
        ["--enable-cuda-graph"] + argv
    assert needle in _err(capsys, argv, world)


def test_cuda_graph_accepts_mlp_act_recompute(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    a = parse_args(BASE + ["--enable-cuda-graph", "--attention-dropout", "0", "--bf16", "--recompute-granularity",
                           "selective", "--recompute-modules", "mlp_act"], world_size=1)
    assert a.training.enable_cuda_graph and a.model.recompute_modules == ("mlp_act",)
    assert a.training.cuda_graph_warmup_steps == 3


def test_microbatch_means_are_what_the_eager_step_and_the_cuda_graph_report():
    import torch

    from megatron.training.training import microbatch_means

    stats = [{"lm loss": torch.tensor(2.0, dtype=torch.bfloat16), "z": torch.tensor([1.0])},
             {"lm loss": torch.tensor(3.0, dtype=torch.bfloat16), "z": torch.tensor([4.0])}]
    means = microbatch_means(stats)
    assert list(means) == ["lm loss", "z"] and all(v.dtype == torch.float32 and v.dim() == 0 for v in means.values())
    assert means["lm loss"].item() == 2.5 and means["z"].item() == 2.5
    assert microbatch_means([]) == {}
