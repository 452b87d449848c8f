"""bench/plan_validation.py and megatron/training/plan_validation.py: measurement records, their comparison with
the predictions of several calibrations, and the whole --run path at tiny shapes on the CPU."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megatron.core.planner import load_calibration, predict
from megatron.training.plan_inputs import inputs_from_argv
from megatron.training.plan_validation import compare, load_measurements, markdown, summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _bench():
    spec = importlib.util.spec_from_file_location("plan_validation", os.path.join(ROOT, "bench", "plan_validation.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record(name, flags, ms, gib, gpus=1):
    return {"config": name, "command": f"pretrain_gpt.py {flags}", "planner_flags": flags, "gpus": gpus,
            "measured_ms_per_iter": ms, "measured_peak_mem_gib": gib}


def test_every_configuration_is_predicted_and_covers_the_required_kinds():
    bench = _bench()
    names = [c[0] for c in bench.CONFIGS]
    assert len(names) >= 12 and len(set(names)) == len(names)
    assert sum(c[1] == "pretrain_bert.py" for c in bench.CONFIGS) >= 2
    flags = [c[3] for c in bench.CONFIGS]
    for needle in ("--hidden-size 768", "--hidden-size 2048", "--hidden-size 1024", "--recompute-granularity full",
                   "--recompute-granularity selective", "--fp8-format hybrid", "--micro-batch-size 1 ",
                   "--micro-batch-size 8 "):
        assert any(needle in f for f in flags), needle
    cal = load_calibration("h200")
    for name, entry, gpus, f in bench.CONFIGS + bench.TINY:  # every flag set parses and fits one H200
        extra = " --model bert --vocab-size 30522" if entry == "pretrain_bert.py" else ""
        shape, layout, cluster, gbs = inputs_from_argv((bench.full_flags(f) + extra).split(), num_gpus=gpus)
        assert predict(shape, layout, cluster, cal, gbs).fits, name
        assert (shape.hidden_dropout > 0) == ("dropout" in name), name  # a config's own dropout is kept


def test_compare_predicts_each_record_with_every_calibration(tmp_path):
    base = load_calibration("h200")
    base["overheads"] = dict(base["overheads"], host_ms_per_layer={})  # else the tiny model is host-bound
    slow = dict(base, gemm_tflops={k: [[x, r / 2] for x, r in v] for k, v in base["gemm_tflops"].items()})
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
             "--global-batch-size 4 --bf16")
    shape, layout, cluster, gbs = inputs_from_argv(flags.split(), num_gpus=1)
    fast_pred, slow_pred = predict(shape, layout, cluster, base, gbs), predict(shape, layout, cluster, slow, gbs)
    assert slow_pred.ms_per_iter > fast_pred.ms_per_iter
    ms, gib = round(slow_pred.ms_per_iter, 1), round(fast_pred.peak_bytes / 2 ** 30 * 1.2, 3)
    rows = compare([_record("tiny", flags, ms, gib)], {"slow": slow, "shipped": base})
    row = rows[0]
    assert row["predicted_ms_per_iter"] == row["by_calibration"]["slow"]["predicted_ms_per_iter"] == ms
    assert row["time_error"] == 0.0 and row["time_within_15pct"]
    assert row["by_calibration"]["shipped"]["time_error"] == pytest.approx(round(fast_pred.ms_per_iter, 1) / ms - 1,
                                                                          abs=1e-4)
    assert row["mem_error"] == pytest.approx(round(fast_pred.peak_bytes / 2 ** 30, 2) / gib - 1, abs=1e-4)
    assert not row["mem_within_10pct"]  # 1/1.2 - 1 = -17%
    assert summary(rows) == "memory within +-10%: 0/1; time within +-15%: 1/1"
    text = markdown(rows, "t", {"slow": "a.json", "shipped": "b.json"}, "cmd")
    assert "| tiny |" in text and "slow ms" in text and "shipped ms" in text


def test_load_measurements_names_the_file_and_the_missing_key(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"measurements": [{"config": "x", "gpus": 1}]}))
    with pytest.raises(ValueError, match=r"m\.json: record 0 lacks command, planner_flags"):
        load_measurements(str(path))
    path.write_text("{")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_measurements(str(path))


def test_tiny_run_calibrates_measures_and_compares_again(tmp_path):
    """The GPU command at tiny shapes on the CPU: calibration first, one configuration measured by its own
    process, the results written; then the saved measurements predicted again without running anything."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "plan_validation.py"), "--run", "--tiny",
                           "--calibrate-first", "--only", "tiny_gpt_mb2_selective", "--iters", "1", "--warmup", "1",
                           "--results-dir", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tiny_gpt_mb2_selective:" in proc.stdout and "done in" in proc.stdout
    cal = load_calibration(str(out / "cpu.json"))
    assert cal["gpu_kind"] == "cpu" and cal["overheads"]["host_ms_per_layer"]["bf16"] > 0
    records = load_measurements(str(out / "plan_measurements.json"))
    assert [r["config"] for r in records] == ["tiny_gpt_mb2_selective"]
    assert records[0]["measured_ms_per_iter"] > 0 and len(records[0]["iter_ms"]) == 1
    with open(out / "plan_validation.json") as f:
        rows = json.load(f)
    assert set(rows[0]["by_calibration"]) == {"calibrated", "shipped"}
    for key in ("config", "command", "predicted_peak_mem_gib", "measured_peak_mem_gib", "predicted_ms_per_iter",
                "measured_ms_per_iter"):
        assert key in rows[0]
    assert (out / "plan_validation.md").read_text().count("| tiny_gpt_mb2_selective |") == 1
    assert (out / "plan_validation_logs" / "tiny_gpt_mb2_selective.log").stat().st_size > 0
    # comparison apart from measurement: the saved records give the same rows again
    again = compare(records, {"calibrated": cal, "shipped": load_calibration("h200")})
    assert again == rows


def test_host_floor_bounds_small_runs_and_cuda_graphs_remove_it():
    from megatron.core.planner import Cluster, Layout, ModelShape

    shipped = load_calibration("h200")
    nofloor = dict(shipped, overheads={**shipped["overheads"], "host_ms_per_layer": {}})
    floor = dict(shipped, overheads={**shipped["overheads"], "host_ms_per_layer": {"bf16": 1.0, "fp8": 2.0}})
    shape = ModelShape(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024)
    one = Cluster(num_gpus=1, gpu_memory_gb=141)

    def per_mb(layout, cal, model=shape):
        return predict(model, layout, one, cal, 16).time.per_microbatch * 1e3

    fixed = shipped["overheads"]["per_microbatch_ms"]
    frac = shipped["overheads"]["host_recompute_fraction"]
    assert 1 / 3 < frac < 1  # the recomputed forward: more than its third of the launches, less than a layer
    assert per_mb(Layout(), nofloor) < 12.0  # the GPU work of 1 x 1024 tokens is far below 12 ms
    assert per_mb(Layout(), floor) == pytest.approx(12 * 1.0 + fixed)  # host-bound: the floor decides
    assert per_mb(Layout(precision="fp8"), floor) == pytest.approx(12 * 2.0 + fixed)
    full = Layout(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert per_mb(full, floor) == pytest.approx(12 * (1 + frac) + fixed)  # the recomputed forwards run again
    bert = ModelShape(model="bert", num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=128,
                      vocab_size=30522)
    head = shipped["overheads"]["host_ms_per_microbatch"]["bert"]
    assert head > 0 and per_mb(Layout(), floor, bert) == pytest.approx(12 * 1.0 + head + fixed)
    assert per_mb(Layout(cuda_graph=True), floor) == per_mb(Layout(), nofloor)
    big = Layout(micro_batch_size=16)  # GPU-bound: 16k tokens take longer than the floor
    assert per_mb(big, floor) == per_mb(big, nofloor)


def test_gemm_tables_take_the_running_maximum_and_fp8_at_least_bf16():
    from megatron.core.planner.calibrate import derive_gemm_tables

    measured = {"bf16": [[4e9, 100.0], [1e9, 30.0], [1.6e10, 80.0], [6.4e10, 300.0]],
                "fp8": [[1e9, 5.0], [4e9, 150.0], [1.6e10, 60.0], [6.4e10, 200.0]]}
    out = derive_gemm_tables(measured)
    assert out["bf16"] == [[1e9, 30.0], [4e9, 100.0], [1.6e10, 100.0], [6.4e10, 300.0]]  # 80 at 1.6e10: throttled
    assert out["fp8"] == [[1e9, 30.0], [4e9, 150.0], [1.6e10, 150.0], [6.4e10, 300.0]]
    assert measured["bf16"][2] == [1.6e10, 80.0]  # the measured table is left as it was
    shipped = load_calibration("h200")
    assert shipped["gemm_tflops"] == derive_gemm_tables(shipped["gemm_tflops_measured"])


def test_shipped_calibration_on_the_h200_measurements():
    """The H200 runs of bench/results/plan_measurements.json predicted again with the shipped calibration."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "results", "plan_measurements.json")
    rows = compare(load_measurements(path), {"shipped": load_calibration("h200")})
    assert len(rows) == 14
    assert all(r["mem_within_10pct"] for r in rows), [(r["config"], r["mem_error"]) for r in rows]
    misses = [(r["config"], r["time_error"]) for r in rows if not r["time_within_15pct"]]
    assert len(misses) <= 2, misses
    fitted = {"gpt124m_mb4_none", "gpt124m_mb8_full", "bert_large_mb8_none", "bert_large_mb8_full"}
    assert sum(r["time_within_15pct"] for r in rows if r["config"] not in fitted) >= 8  # out of sample
