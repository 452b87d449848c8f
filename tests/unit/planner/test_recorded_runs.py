"""The shipped H200 calibration against the training runs recorded in bench/results: peak memory within 10% and
iteration time within 15% for every recorded run (GPT 124M and 1.3B; none/selective/full recomputation; bf16 and
FP8; TP 2, PP 2, DP 2 with the distributed optimizer). These are the runs its fitted entries were chosen on, so
this guards the model against regressions; bench/plan_validation.py --run measures fresh configurations."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _validation_module():
    spec = importlib.util.spec_from_file_location("plan_validation", os.path.join(ROOT, "bench", "plan_validation.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recorded_runs_within_tolerance():
    mod = _validation_module()
    from megatron.core.planner import load_calibration

    rows = mod.from_records(load_calibration("h200"))
    assert len(rows) >= 10
    for row in rows:
        assert abs(row["mem_error"]) <= 0.10, row
        assert abs(row["time_error"]) <= 0.15, row
        # the recorded measurement is read from the file named as its source
        with open(os.path.join(ROOT, row["source"])) as f:
            text = f.read()
        assert f"| {row['measured_ms_per_iter']} |" in text or f"{row['measured_ms_per_iter']} (" in text, row
