"""The planner's predictions set against measured runs: one row per run, the tolerances, the Markdown table.

Measurement and comparison are apart: ``bench/plan_validation.py --run`` writes what it measured (one record per
run, ``plan_measurements.json``) and this module predicts every record again with one or more calibrations, so a
changed memory or time model is checked against the same measurements without a GPU
(``bench/plan_validation.py --from-measurements FILE``).

A measurement record: ``config`` (a name), ``command`` (the trainer command line, for the reader), ``planner_flags``
(the trainer's flags the planner reads, ``--model bert`` and ``--vocab-size`` included; read with the
trainer's parser, ``megatron/training/plan_inputs.py``), ``gpus``,
``measured_ms_per_iter``, ``measured_peak_mem_gib`` (``torch.cuda.max_memory_allocated``; null on a CPU) and
optionally ``measured_reserved_gib``, ``outside_allocator_gib``, ``wall_s``, ``source``.
"""

from __future__ import annotations

import json
import shlex
from typing import Dict, List, Optional

from megatron.core.planner.predict import predict
from megatron.training.plan_inputs import inputs_from_argv

MEM_TOL, TIME_TOL = 0.10, 0.15
REQUIRED = ("config", "command", "planner_flags", "gpus", "measured_ms_per_iter", "measured_peak_mem_gib")
GIB = 2 ** 30


def predicted(planner_flags: str, gpus: int, calibration: dict) -> dict:
    """Predicted allocator peak (GiB) and ms/iteration of a trainer flag set on ``gpus`` GPUs."""
    shape, layout, cluster, gbs = inputs_from_argv(shlex.split(planner_flags), num_gpus=gpus)
    pred = predict(shape, layout, cluster, calibration, gbs)
    return {"predicted_peak_mem_gib": round(pred.peak_bytes / GIB, 2),
            "predicted_ms_per_iter": round(pred.ms_per_iter, 1)}


def _errors(pred: dict, ms: Optional[float], gib: Optional[float]) -> dict:
    out = {}
    if gib:
        out["mem_error"] = round(pred["predicted_peak_mem_gib"] / gib - 1, 4)
        out["mem_within_10pct"] = abs(out["mem_error"]) <= MEM_TOL
    if ms:
        out["time_error"] = round(pred["predicted_ms_per_iter"] / ms - 1, 4)
        out["time_within_15pct"] = abs(out["time_error"]) <= TIME_TOL
    return out


def compare(measurements: List[dict], calibrations: Dict[str, dict]) -> List[dict]:
    """One row per measurement: predictions with every calibration (``label -> calibration``), the first label's
    at the top level (``predicted_peak_mem_gib``, ``predicted_ms_per_iter``, ``mem_error``, ``time_error``) and
    each label's under ``by_calibration``."""
    if not calibrations:
        raise ValueError("compare needs at least one calibration")
    rows = []
    for rec in measurements:
        ms, gib = rec["measured_ms_per_iter"], rec["measured_peak_mem_gib"]
        by_cal = {}
        for label, cal in calibrations.items():
            pred = predicted(rec["planner_flags"], rec["gpus"], cal)
            by_cal[label] = {**pred, **_errors(pred, ms, gib)}
        first = by_cal[next(iter(calibrations))]
        row = {"config": rec["config"], "command": rec["command"],
               "predicted_peak_mem_gib": first["predicted_peak_mem_gib"], "measured_peak_mem_gib": gib,
               "predicted_ms_per_iter": first["predicted_ms_per_iter"], "measured_ms_per_iter": ms,
               **{k: first[k] for k in ("mem_error", "mem_within_10pct", "time_error", "time_within_15pct")
                  if k in first}}
        if len(calibrations) > 1:
            row["by_calibration"] = by_cal
        for key in ("measured_reserved_gib", "outside_allocator_gib", "wall_s", "source"):
            if rec.get(key) is not None:
                row[key] = rec[key]
        rows.append(row)
    return rows


def load_measurements(path: str) -> List[dict]:
    """The records of a measurements file; one clear error naming the file when it is unusable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"measurements file {path}: not readable JSON ({exc})") from None
    records = data.get("measurements") if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise ValueError(f"measurements file {path}: expected a list of records or {{\"measurements\": [...]}}")
    for i, rec in enumerate(records):
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"measurements file {path}: record {i} lacks {', '.join(missing)}")
    return records


def _pct(row: dict, key: str) -> str:
    return f"{100 * row[key]:+.1f}%" if key in row else "n/a"


def summary(rows: List[dict], label: Optional[str] = None) -> str:
    """``memory within +-10%: a/b; time within +-15%: c/d`` for the top-level or one calibration's predictions."""
    picked = [r["by_calibration"][label] if label else r for r in rows]
    mem = [p for p in picked if "mem_error" in p]
    tim = [p for p in picked if "time_error" in p]
    return (f"memory within +-10%: {sum(p['mem_within_10pct'] for p in mem)}/{len(mem)}; "
            f"time within +-15%: {sum(p['time_within_15pct'] for p in tim)}/{len(tim)}")


def markdown(rows: List[dict], title: str, calibrations: Dict[str, str], command: str, notes=()) -> str:
    """The table of ``rows``; ``calibrations``: label -> file, in the order ``compare`` got them."""
    labels = list(calibrations)
    out = [f"# {title}", "", f"Command: `{command}`", ""]
    out += [f"- calibration `{label}`: `{path}`" + (" (the top-level predictions)" if i == 0 else "")
            for i, (label, path) in enumerate(calibrations.items())]
    out += ["", "Within tolerance (" + labels[0] + "): " + summary(rows) + "."]
    for label in labels[1:]:
        out.append(f"With `{label}`: " + summary(rows, label) + ".")
    out += [""] + list(notes) + ([""] if notes else [])
    head = "| config | measured GiB | measured ms |"
    sep = "|---|---|---|"
    for label in labels:
        head += f" {label} GiB | error | {label} ms | error |"
        sep += "---|---|---|---|"
    out += [head, sep]
    for r in rows:
        cells = f"| {r['config']} | {r['measured_peak_mem_gib'] if r['measured_peak_mem_gib'] else 'n/a'} | " \
                f"{r['measured_ms_per_iter']} |"
        for label in labels:
            p = r["by_calibration"][label] if len(labels) > 1 else r
            cells += (f" {p['predicted_peak_mem_gib']} | {_pct(p, 'mem_error')} | {p['predicted_ms_per_iter']} | "
                      f"{_pct(p, 'time_error')} |")
        out.append(cells)
    ratios = sorted(r["measured_reserved_gib"] / r["measured_peak_mem_gib"] for r in rows
                    if r.get("measured_reserved_gib") and r.get("measured_peak_mem_gib"))
    outside = sorted(r["outside_allocator_gib"] for r in rows if r.get("outside_allocator_gib") is not None)
    if ratios:
        out += ["", f"Allocator: reserved / allocated peak {ratios[0]:.3f}-{ratios[-1]:.3f} (calibration "
                f"memory.reserved_over_allocated: use {ratios[-1]:.3f})."]
    if outside:
        out.append(f"Device memory outside the allocator {outside[0]:.2f}-{outside[-1]:.2f} GiB "
                   f"(memory.outside_allocator_bytes: use {outside[-1] * GIB:.3g}).")
    out += ["", "Commands:", ""] + [f"- {r['config']}: `{r['command']}`" for r in rows]
    return "\n".join(out) + "\n"
