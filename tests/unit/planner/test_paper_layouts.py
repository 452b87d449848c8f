"""The planner on Korthikanti et al. 2022's largest layouts (80 GB GPUs, sequence parallelism and selective
recomputation), its search over TP without SP, and its one GPU-memory default."""

import json
import os
import sys

import pytest

from megatron.core.planner import Cluster, Layout, ModelShape, load_calibration, predict
from megatron.core.planner.memory import layer_activation_bytes
from megatron.core.planner.predict import SearchSpace, enumerate_layouts
from megatron.core.planner.timing import calibrated_gpu_memory_gb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan  # noqa: E402

GIB = 2 ** 30
# the paper's Table 3: layers, hidden, heads, TP, PP, interleaved stages per rank, GPUs = global batch
PAPER_1T = (128, 25600, 160, 8, 64, None, 512)
PAPER_530B = (105, 20480, 128, 8, 35, 3, 280)


def _predict(cfg, sp=True, recompute="selective", modules=("core_attn",), fused_bda=True):
    L, h, a, t, pp, vpp, gpus = cfg
    shape = ModelShape(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=2048, vocab_size=51200)
    layout = Layout(tp=t, pp=pp, vpp=vpp, sp=sp, micro_batch_size=1, recompute_granularity=recompute,
                    recompute_modules=modules, bias_dropout_fusion=fused_bda)
    return shape, layout, predict(shape, layout, Cluster(num_gpus=gpus, gpu_memory_gb=80), load_calibration("h200"),
                                  gpus)


@pytest.mark.parametrize("cfg", [PAPER_1T, PAPER_530B], ids=["1T", "530B"])
@pytest.mark.parametrize("modules", [("core_attn",), ("core_attn", "mlp_act")])
@pytest.mark.parametrize("fused_bda", [False, True])
def test_paper_layouts_fit_in_80gb_with_sp_and_selective_recomputation(cfg, modules, fused_bda):
    shape, layout, pred = _predict(cfg, modules=modules, fused_bda=fused_bda)
    assert pred.fits, pred.required_bytes / GIB
    if modules == ("core_attn",) and not fused_bda:  # the paper's setting: 34 sbh/t per layer
        sbh_t = 2048 * shape.hidden_size / layout.tp
        assert layer_activation_bytes(shape, layout, "selective") == pytest.approx(34 * sbh_t, rel=2e-3)


def test_paper_1t_layout_needs_sequence_parallelism():
    """Without SP the 1T layout keeps 10 sbh + 24 sbh/t per layer and does not fit; with SP it keeps 34 sbh/t."""
    _, _, with_sp = _predict(PAPER_1T)
    _, _, without = _predict(PAPER_1T, sp=False)
    assert with_sp.fits and not without.fits
    heavy = lambda p: p.stages[p.heaviest_stage].activations  # noqa: E731
    assert heavy(without) / heavy(with_sp) > 2.5


def test_search_plans_tensor_parallelism_with_and_without_sp():
    shape = ModelShape(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512)
    layouts = list(enumerate_layouts(shape, Cluster(num_gpus=4, gpu_memory_gb=80), 8, SearchSpace(
        precisions=["bf16"], recompute=["none"], micro_batch_sizes=[1], vpp=[None])))
    tp2 = [lay for lay in layouts if lay.tp == 2 and lay.pp == 1 and not lay.distributed_optimizer]
    assert sorted(lay.sp for lay in tp2) == [False, True]
    assert len([lay for lay in layouts if lay.tp == 1 and lay.pp == 1 and not lay.distributed_optimizer]) == 1
    # TP without SP keeps the LayerNorm regions whole: more activation bytes than with SP
    assert layer_activation_bytes(shape, tp2[0], "none") > layer_activation_bytes(shape, tp2[1], "none")


def test_one_gpu_memory_default(capsys):
    """tools/plan.py and --dry-run check fits against the calibration's device memory (H200: 150.11 GB = 139.8 GiB
    as CUDA reports it) unless --gpu-memory-gb is given."""
    from megatron.training.dry_run import dry_run

    memory = calibrated_gpu_memory_gb(load_calibration("h200"))
    assert memory * 1e9 / GIB == pytest.approx(139.8, abs=0.05)
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--global-batch-size", "8", "--num-gpus", "2", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1", "--bf16", "--json"]
    assert plan.main(argv) == 0
    limits = {p["memory_limit_gib"] for p in json.loads(capsys.readouterr().out)["predictions"]}
    assert limits and all(x == pytest.approx(memory * 1e9 / GIB) for x in limits)
    text, _ = dry_run(argv[:-1], num_gpus=2)
    assert f"({memory:g} GB each)" in text
    assert plan.main(argv + ["--gpu-memory-gb", "80"]) == 0
    limits = {p["memory_limit_gib"] for p in json.loads(capsys.readouterr().out)["predictions"]}
    assert limits and all(x == pytest.approx(80e9 / GIB) for x in limits)


def test_unfused_bias_dropout_add_keeps_its_masks():
    """``--no-bias-dropout-fusion`` (the trainer's flag, read by the planner) adds the two 1-byte hidden-dropout
    masks the fused kernel does not keep."""
    from megatron.training.plan_inputs import inputs_from_argv

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --global-batch-size 2 "
            "--micro-batch-size 2 --bf16 --hidden-dropout 0.1").split()
    _, fused, _, _ = inputs_from_argv(base, num_gpus=1)
    shape, unfused, _, _ = inputs_from_argv(base + ["--no-bias-dropout-fusion"], num_gpus=1)
    assert fused.bias_dropout_fusion and not unfused.bias_dropout_fusion
    extra = layer_activation_bytes(shape, unfused, "none") - layer_activation_bytes(shape, fused, "none")
    assert extra == 2 * 64 * 2 * 64  # two masks of s x b x h bytes
