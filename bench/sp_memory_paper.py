"""Korthikanti et al. 2022's model configurations: activation bytes per layer by the paper, by the planner and as
measured on the CPU, and whether the planner fits each layout in 80 GB with sequence parallelism and selective
recomputation; then, per case (no parallelism, TP, TP+SP, selective and full recomputation at TP 1, 2 and 4), the
bytes the test measures next to the paper's Eq. 1-6 and the named differences.

The measurement runs our TransformerBlock on 8 gloo processes (TP 8, sequence parallelism, selective
recomputation of the attention core, unfused attention, dropout 0.1, bf16) at two reduced shapes and counts the
bytes of the distinct storages autograd saves (``tests/unit/planner/test_activations.py``'s counter). With the
attention core recomputed a layer keeps ``alpha sbh/t + beta sb/t`` bytes (nothing grows with s^2); the two shapes
give alpha and beta, which then give the bytes of a layer of each full-size configuration.

    python bench/sp_memory_paper.py        # a few minutes on 2 cores; writes bench/results/sp_memory_paper.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results_io import run_meta, write_results  # noqa: E402
from megatron.core.parallel_state import ParallelState  # noqa: E402
from megatron.core.planner import Layout, ModelShape, load_calibration  # noqa: E402
from megatron.core.planner.memory import layer_activation_bytes  # noqa: E402
from megatron.core.planner.predict import predict  # noqa: E402
from megatron.core.planner.shapes import Cluster  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

T = 8
SEQ, BATCH = 2048, 1
VOCAB = 51200
# the paper's Table 3: layers, hidden, heads, TP, PP, interleaved stages per rank, global batch (= GPUs: DP 1)
CONFIGS = {
    "22B": (48, 6144, 64, 8, 1, None, 4),
    "175B": (96, 12288, 96, 8, 8, None, 64),
    "530B": (105, 20480, 128, 8, 35, 3, 280),
    "1T": (128, 25600, 160, 8, 64, None, 512),
}
SHAPES = ((64, 64, 8), (64, 128, 8))  # reduced (s, h, a) measured at TP 8; b = tests' B
GIB = 2 ** 30


def _worker(rank, world_size, out_path):
    from tests.unit.planner.test_activations import B, saved_bytes_per_layer

    pstate = ParallelState.build(tensor_model_parallel_size=world_size)
    layout = Layout(tp=world_size, sp=True, micro_batch_size=B, attention_backend="unfused",
                    recompute_granularity="selective", recompute_modules=("core_attn",))
    rows = [(s, h, a, B, saved_bytes_per_layer(pstate, h, a, None, layout, 0.1, attention_dropout=0.1, s=s))
            for s, h, a in SHAPES]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def _cases_worker(rank, world_size, out_path):
    from tests.unit.planner.test_activations import PAPER_CASES, check_against_paper

    rows = []
    for tp in (4, 2):
        pstate = ParallelState.build(tensor_model_parallel_size=tp)
        found = check_against_paper(pstate, [n for n in PAPER_CASES if n.startswith("tp")])
        rows += [(name, tp, *found[name]) for name in found]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def measure_cases() -> list:
    """``(case, TP, measured, paper, named differences)`` per layer at the test's reduced shape (the test's own
    assertions run too: measured == planner, measured - differences == paper within 2%)."""
    from tests.unit.planner.test_activations import check_against_paper

    found = check_against_paper(ParallelState.single(), ["none", "selective", "selective_with_mlp_act", "full"])
    rows = [(name, 1, *found[name]) for name in found]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cases.json")
        run_distributed(_cases_worker, 4, (path,))
        with open(path) as f:
            rows += [tuple(r) for r in json.load(f)]
    return rows


def measure_coefficients() -> dict:
    """alpha (bytes per sbh/t) and beta (bytes per sb/t) of one TP-8 SP layer with selective recomputation."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        run_distributed(_worker, T, (path,))
        with open(path) as f:
            rows = json.load(f)
    (s1, h1, _, b1, y1), (s2, h2, _, b2, y2) = rows
    # y = alpha s b h / t + beta s b / t at two hidden sizes (same s, b)
    u1, u2 = y1 * T / (s1 * b1), y2 * T / (s2 * b2)  # = alpha h + beta
    alpha = (u2 - u1) / (h2 - h1)
    beta = u1 - alpha * h1
    return {"rows": rows, "alpha": alpha, "beta": beta}


def paper_first_stage(L, h, t, pp, vpp) -> float:
    """The paper's activation memory of the first pipeline stage: 34 sbh L / t, times 1 + (p - 1) / (p m) with m
    interleaved stages per rank."""
    base = 34 * SEQ * BATCH * h * L / t
    return base * (1 + (pp - 1) / (pp * vpp)) if vpp else base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    meta = run_meta("sp_memory_paper.py")
    coef = measure_coefficients()
    cases = measure_cases()
    cal = load_calibration("h200")
    rows = []
    for name, (L, h, a, t, pp, vpp, gbs) in CONFIGS.items():
        shape = ModelShape(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=SEQ, vocab_size=VOCAB)
        sbh_t = SEQ * BATCH * h / t
        row = {"model": name, "layers": L, "hidden": h, "heads": a, "tp": t, "pp": pp, "vpp": vpp,
               "global_batch": gbs, "paper_layer_mib": 34 * sbh_t / 2 ** 20,
               "measured_cpu_layer_mib": (coef["alpha"] * sbh_t + coef["beta"] * SEQ * BATCH / t) / 2 ** 20,
               "paper_first_stage_gib": paper_first_stage(L, h, t, pp, vpp) / GIB}
        for label, fused in (("unfused_bda", False), ("fused_bda", True)):
            layout = Layout(tp=t, pp=pp, vpp=vpp, sp=True, micro_batch_size=BATCH, recompute_granularity="selective",
                            recompute_modules=("core_attn",), bias_dropout_fusion=fused)
            pred = predict(shape, layout, Cluster(num_gpus=t * pp, gpu_memory_gb=80), cal, gbs)
            heavy = pred.stages[pred.heaviest_stage]
            row[f"planner_{label}_layer_mib"] = layer_activation_bytes(shape, layout, "selective") / 2 ** 20
            row[f"planner_{label}_activations_gib"] = heavy.activations / GIB
            row[f"planner_{label}_required_gib"] = pred.required_bytes / GIB
            row[f"planner_{label}_fits_80gb"] = pred.fits
        rows.append(row)
    body = [f"Measured on the CPU (TP {T} on gloo, SP, selective recomputation of the attention core, unfused "
            f"attention, dropout 0.1, bf16) at (s, h, a) = {', '.join(str(x[:3]) for x in coef['rows'])}, b = "
            f"{coef['rows'][0][3]}: a layer keeps {coef['alpha']:.3f} sbh/t + {coef['beta']:.3f} sb/t bytes (the "
            "paper: 34 sbh/t; the CPU's dropout keeps 2-byte masks where CUDA keeps 1-byte ones: +2 sbh/t; "
            "LayerNorm mean and rstd: 8 sb/t, in fp32 on CUDA: 16 sb/t).", "",
            "Full-size configurations (seq 2048, micro-batch 1, vocabulary 51,200; SP and selective recomputation "
            "of the attention core; 80 GB = 80e9 bytes). Planner: on CUDA, with the unfused bias-dropout-add "
            "(1-byte masks, as the paper) and with the fused one (the default: no masks).", "",
            "| model | L | h | a | TP | PP | VP | layer MiB: paper | planner (unfused BDA) | planner (fused BDA) | "
            "CPU measured | first stage activations GiB: paper | planner (unfused) | planner (fused) | "
            "required GiB (unfused / fused) | fits 80 GB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        body.append(f"| {r['model']} | {r['layers']} | {r['hidden']} | {r['heads']} | {r['tp']} | {r['pp']} | "
                    f"{r['vpp'] or 1} | {r['paper_layer_mib']:.1f} | {r['planner_unfused_bda_layer_mib']:.1f} | "
                    f"{r['planner_fused_bda_layer_mib']:.1f} | {r['measured_cpu_layer_mib']:.1f} | "
                    f"{r['paper_first_stage_gib']:.1f} | {r['planner_unfused_bda_activations_gib']:.1f} | "
                    f"{r['planner_fused_bda_activations_gib']:.1f} | {r['planner_unfused_bda_required_gib']:.1f} / "
                    f"{r['planner_fused_bda_required_gib']:.1f} | "
                    f"{'yes' if r['planner_unfused_bda_fits_80gb'] and r['planner_fused_bda_fits_80gb'] else 'NO'} |")
    from tests.unit.planner.test_activations import B, P_DROP, PA, PH, PS

    body += ["", f"Per layer at the test's shape (s {PS}, b {B}, h {PH}, a {PA}, unfused attention, hidden and "
             f"attention dropout {P_DROP}, bf16, CPU), as `tests/unit/planner/test_activations.py` measures it "
             "(the planner's CPU prediction is equal in every row):", "",
             "| case | TP | measured bytes | paper (Eq. 1-6) | measured / paper | named differences (bytes) | "
             "measured - differences - paper |", "|---|---|---|---|---|---|---|"]
    for name, tp, measured, paper, diffs in cases:
        named = "; ".join(f"{k}: {v:+,.0f}" for k, v in diffs.items()) or "none"
        body.append(f"| {name} | {tp} | {measured:,.0f} | {paper:,.0f} | {measured / paper:.3f} | {named} | "
                    f"{measured - sum(diffs.values()) - paper:+,.0f} |")
    meta.update(alpha=coef["alpha"], beta=coef["beta"], measured_rows=coef["rows"],
                cases=[{"case": n, "tp": tp, "measured": m, "paper": p, "differences": d} for n, tp, m, p, d in cases])
    write_results(args.results_dir, "sp_memory_paper", meta, rows,
                  "Activation memory of the paper's configurations: paper, planner, CPU measurement", body)
    print("\n".join(body))


if __name__ == "__main__":
    main()
