"""tools/plan.py: the ranked table, JSON output, errors that name the flag, --help and --calibrate (CPU)."""

import json
import os
import sys

import pytest

from megatron.core.planner import Cluster, Layout, ModelShape, load_calibration, predict
from megatron.core.model_counts import num_floating_point_operations
from megatron.core.model_spec import ModelSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan  # noqa: E402

ISSUE_CMD = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
             "--global-batch-size", "512", "--num-gpus", "8", "--gpu-memory-gb", "141"]


def _run(capsys, argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ranked_table_for_a_1p3b_model_on_8_gpus(capsys):
    code, out, _ = _run(capsys, ISSUE_CMD)
    assert code == 0
    lines = out.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("rank"))
    rows = [l.split() for l in lines[start + 2:] if l.strip() and l.split()[0].isdigit()]
    assert len(rows) == 15
    tokens = [int(r[-2].replace(",", "")) for r in rows]
    assert tokens == sorted(tokens, reverse=True)
    assert all("yes" in r for r in rows)
    assert "MFU" in out and "989" in out  # states the peak it divides by
    assert "DOES NOT FIT" not in out and "heaviest stage" in out


def test_json_predictions_are_consistent(capsys):
    code, out, _ = _run(capsys, ISSUE_CMD + ["--json", "--precisions", "bf16", "--micro-batch-sizes", "1,4"])
    assert code == 0
    data = json.loads(out)
    preds = data["predictions"]
    assert preds and data["num_fitting"] == len(preds)
    assert [p["tokens_per_s"] for p in preds] == sorted((p["tokens_per_s"] for p in preds), reverse=True)
    for p in preds:
        assert p["precision"] == "bf16" and p["micro_batch_size"] in (1, 4)
        assert p["peak_mem_gib"] <= p["memory_limit_gib"]
        assert p["peak_mem_gib"] == max(p["stage_peak_mem_gib"])
        lay = p["layout"]
        assert lay["tp"] * lay["pp"] * lay["dp"] == 8
        assert p["tokens_per_s"] == pytest.approx(512 * 2048 / (p["ms_per_iter"] / 1e3))
        # MFU: the trainer's own model-FLOP count per iteration / time / GPUs / the stated peak
        model = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                          padded_vocab_size=50304)
        flops = num_floating_point_operations(model, 512)
        assert p["mfu"] == pytest.approx(flops / (p["ms_per_iter"] / 1e3) / 8 / (p["mfu_peak_tflops"] * 1e12))


def test_fixed_layout_and_pipeline_stages(capsys):
    code, out, _ = _run(capsys, ISSUE_CMD + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                             "4", "--micro-batch-size", "2", "--bf16", "--json", "--all"])
    assert code == 0
    preds = json.loads(out)["predictions"]
    assert preds and all(p["layout"]["tp"] == 2 and p["layout"]["pp"] == 4 for p in preds)
    first = preds[0]
    # the first stage holds the embedding, the last the output layer, tied: same parameter count at these shapes
    assert len(first["stage_peak_mem_gib"]) == 4
    assert first["params_per_rank"][0] > first["params_per_rank"][1]


def test_errors_name_the_flag(capsys):
    bad = list(ISSUE_CMD)
    bad[bad.index("--num-attention-heads") + 1] = "15"
    code, _, err = _run(capsys, bad)
    assert code == 2 and "--num-attention-heads" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(capsys, ISSUE_CMD + ["--gpu-kind", "nonesuch"])
    assert code == 2 and "nonesuch" in err and "--calibrate" in err


def test_nothing_fits_says_how_much_is_needed(capsys):
    code, out, _ = _run(capsys, ISSUE_CMD[:-1] + ["1"])
    assert code == 1 and "nothing fits" in out and "GiB per GPU" in out


def test_help_explains_every_input():
    parser = plan.build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"


def test_prediction_does_not_fit_reports_by_how_much():
    shape = ModelShape(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048)
    pred = predict(shape, Layout(micro_batch_size=16), Cluster(num_gpus=1, gpu_memory_gb=40),
                   load_calibration("h200"), 16)
    assert not pred.fits
    from megatron.core.planner import format_prediction

    assert "DOES NOT FIT" in format_prediction(pred) and "over" in format_prediction(pred)


def test_calibrate_on_cpu_writes_a_usable_file(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cpu.json"
    monkeypatch.setattr(sys, "argv", ["plan.py", "--calibrate", "--calibrate-device", "cpu",
                                      "--calibration-out", str(out), "--quick"])
    assert plan.main() == 0
    cal = load_calibration(str(out))
    assert cal["gemm_tflops"]["bf16"] and all(r > 0 for _, r in cal["gemm_tflops"]["bf16"])
    assert set(cal["attention_tflops"]) == {"64", "128"} and cal["elementwise_gbps"] > 0
    assert set(cal["attention_masked_tflops"]) == {"64"} and cal["attention_masked_tflops"]["64"] > 0
    assert cal["overheads"]["host_ms_per_layer"]["bf16"] > 0  # measured, not carried over
    assert "overheads.per_iteration_ms" in cal["carried_over"]
    assert "memory.outside_allocator_bytes" in cal["carried_over"]
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=500)
    pred = predict(shape, Layout(), Cluster(num_gpus=1, gpu_memory_gb=1), cal, 4)
    assert pred.ms_per_iter > 0


def test_dry_run_reads_a_trainer_command_line():
    from megatron.training.dry_run import dry_run

    argv = ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings "
            "1024 --micro-batch-size 4 --global-batch-size 32 --bf16 --data-path /nonexistent/prefix --lr 1e-4 "
            "--train-iters 10 --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer").split()
    text, fits = dry_run(argv, num_gpus=4)
    assert fits and "TP2 PP1 DP2 SP distopt" in text and "parameters per (tensor, pipeline) rank" in text
    text, fits = dry_run(argv, num_gpus=4, gpu_memory_gb=1)
    assert not fits and "DOES NOT FIT" in text
    with pytest.raises(ValueError, match="--num-gpus 3"):
        dry_run(argv, num_gpus=3)
