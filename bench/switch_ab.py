"""Does each speed switch of the gradient path earn its place? An on/off A/B of each, in one run on one GPU.

Switches (library settings, not flags; each is on by default):
  lazy_grad_zero          ``DDPConfig.lazy_grad_zero``: the gradient buffer is not cleared between iterations
                          (``megatron/core/distributed/ddp_config.py``, ``megatron/core/grad_record.py``)
  small_param_grad_sink   ``megatron.core.grad_record.SMALL_PARAM_GRAD_SINK``: LayerNorm and bias gradients are
                          stored into the buffer by their fused kernels instead of coming back as ``.grad``
  finish_in_last_program  ``megatron.core.fusions._triton_elementwise.FINISH_IN_LAST_PROGRAM``: column sums finish
                          in their last program (an arrival counter) instead of a second launch (needs Triton)

At each shape our trainer runs as in the throughput table (``bench/gpu_throughput.py``'s ``ours`` bf16 rows: the
same flags, the same tokens, one process per run): once with every switch on, then once with each switch off, and
again in further rounds, the order reversed every other round (A B C D, D C B A, ...), so a slow drift of the
GPU's clock or temperature hits every variant alike. A round is skipped when it would not finish within
``--budget-s`` (rounds after the first only). Each run's switch is set in the child process before
``pretrain_gpt.py`` starts (``--run-ours``), and the child confirms it on its output; a switch the library no longer
has is an error naming it.

Writes ``bench/results/switch_ab.{json,md}``: per shape and variant the median iteration time over every timed
iteration of its runs, each run's median, and the difference to "all on" in percent (positive: turning the switch
off is slower, i.e. the switch saves that much). A switch must save at least 1% at one shape to stay.

    python bench/switch_ab.py                                   # GPT-2 124M and GPT 1.3B, two rounds
    python bench/switch_ab.py --shapes tiny --iters 2 --warmup 1 --rounds 1 --results-dir /tmp/switch_ab
                                                                # a check of the script on the CPU
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from corpus import prepare_dataset  # noqa: E402
from gpu_throughput import SHAPES, comma_choices, ours_flags, parse_ours_log, run_ours_wrapper  # noqa: E402
from results_io import run_meta, write_results  # noqa: E402

# Flags of our bf16 rows in the throughput table (bench/gpu_session.sh table) beyond the shape and OURS_BASE_ARGS.
SHAPE_ARGS = {
    "1.3b": "--recompute-granularity selective --recompute-modules mlp_act --recompute-num-layers 12",
    "124m": "--enable-cuda-graph",
    "tiny": "",
}
SWITCHES = {  # name: (module, attribute); lazy_grad_zero is a DDPConfig field, the others module-level flags
    "lazy_grad_zero": ("megatron.core.distributed.ddp_config", "DDPConfig.lazy_grad_zero"),
    "small_param_grad_sink": ("megatron.core.grad_record", "SMALL_PARAM_GRAD_SINK"),
    "finish_in_last_program": ("megatron.core.fusions._triton_elementwise", "FINISH_IN_LAST_PROGRAM"),
}
ALL_ON = "all on"
APPLIED = "SWITCH_AB_OFF"  # the child's confirmation line: "SWITCH_AB_OFF <name>"
PASS_THRESHOLD = 1.0  # percent of an iteration a switch must save at one shape at least


def unavailable_reason(switch: str):
    """Why ``switch`` cannot be turned off on this machine, or None."""
    if switch == "finish_in_last_program" and importlib.util.find_spec("triton") is None:
        return "Triton is not installed (the column-sum kernels it switches do not run)"
    return None


def turn_off(switch: str) -> None:
    """In the child process, before the trainer starts: set ``switch`` to off; print the confirmation once the
    trainer has picked it up (lazy_grad_zero: when the trainer builds its DDPConfig)."""
    module_name, attribute = SWITCHES[switch]
    module = importlib.import_module(module_name)
    if switch == "lazy_grad_zero":
        from megatron.training import setup

        config_class = module.DDPConfig
        if "lazy_grad_zero" not in getattr(config_class, "__dataclass_fields__", {}):
            raise SystemExit(f"switch_ab: {module_name}.{attribute} no longer exists; update SWITCHES")

        def ddp_config_without_lazy_zero(**kwargs):
            config = config_class(**kwargs, lazy_grad_zero=False)
            print(f"{APPLIED} {switch}", flush=True)
            return config

        setup.DDPConfig = ddp_config_without_lazy_zero  # what build_model calls to build its DDPConfig
        return
    if not hasattr(module, attribute):
        raise SystemExit(f"switch_ab: {module_name}.{attribute} no longer exists; update SWITCHES")
    setattr(module, attribute, False)  # read at every call
    print(f"{APPLIED} {switch}", flush=True)


def run_one(shape: str, switch, iters: int, warmup: int, data_prefix: str, log_path) -> dict:
    """One run of pretrain_gpt.py at ``shape`` with ``switch`` off (None: all on); its timed iterations."""
    flags = ours_flags(SHAPES[shape], iters, warmup, data_prefix, SHAPE_ARGS.get(shape, ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--run-ours", switch or "none", "--",
           os.path.join(ROOT, "pretrain_gpt.py")] + flags
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log_path:
        with open(log_path, "w") as f:
            f.write(proc.stdout)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], flush=True)
        raise RuntimeError(f"pretrain_gpt.py ({switch or ALL_ON}, {shape}) exited with {proc.returncode}")
    if switch and f"{APPLIED} {switch}" not in proc.stdout:
        raise RuntimeError(f"switch {switch} was not taken up by the trainer (no '{APPLIED} {switch}' line)")
    res = parse_ours_log(proc.stdout, warmup)
    return {"iter_ms": res["iter_ms"], "median_ms": statistics.median(res["iter_ms"]),
            "wall_s": round(time.time() - t0, 1),
            "command": "python pretrain_gpt.py " + " ".join(shlex.quote(c) for c in flags)}


def summarise(runs: list, shapes: list, variants: list) -> list:
    """Per shape and variant: pooled median, run medians, and the difference to all on (percent)."""
    rows = []
    for shape in shapes:
        pooled = {v: [t for r in runs if r["shape"] == shape and r["variant"] == v for t in r["iter_ms"]]
                  for v in variants}
        base = statistics.median(pooled[ALL_ON]) if pooled[ALL_ON] else None
        for v in variants:
            mine = [r for r in runs if r["shape"] == shape and r["variant"] == v]
            if not mine:
                continue
            ms = statistics.median(pooled[v])
            rows.append({"shape": shape, "variant": v, "median_ms": round(ms, 3),
                         "run_medians_ms": [round(r["median_ms"], 3) for r in mine],
                         "slower_without_pct": None if base is None or v == ALL_ON else
                         round(100.0 * (ms - base) / base, 2)})
    return rows


def markdown(rows: list, skipped: dict, rounds_done: int, args) -> list:
    body = [f"Our trainer (bf16, as the throughput table's `ours` rows) with every switch on, then each switch off, "
            f"{rounds_done} round(s), the order reversed every other round; {args.iters} timed iterations per run "
            f"after {args.warmup} warm-up ones. \"Slower without\": the median iteration time with the switch off "
            "against all on (positive: the switch saves that much).", "",
            "| shape | variant | median ms/iter | each run's median | slower without |", "|---|---|---|---|---|"]
    for r in rows:
        diff = "" if r["slower_without_pct"] is None else f"{r['slower_without_pct']:+.2f}%"
        each = ", ".join(f"{x:.2f}" for x in r["run_medians_ms"])
        body.append(f"| {r['shape']} | {r['variant']} | {r['median_ms']:.2f} | {each} | {diff} |")
    for r in rows:  # the spread of the reference's own runs: the noise a difference must stand out of
        if r["variant"] == ALL_ON and len(r["run_medians_ms"]) > 1:
            spread = 100.0 * (max(r["run_medians_ms"]) - min(r["run_medians_ms"])) / r["median_ms"]
            body += ["", f"Noise at {r['shape']}: the all-on runs' medians span {spread:.2f}% of its median."]
    body += ["", f"Verdict (a switch stays if it saves at least {PASS_THRESHOLD:g}% at one shape):", ""]
    for switch in SWITCHES:
        if switch in skipped:
            body.append(f"- {switch}: not measured ({skipped[switch]})")
            continue
        diffs = {r["shape"]: r["slower_without_pct"] for r in rows if r["variant"] == f"{switch} off"}
        best = max(diffs.values()) if diffs else None
        verdict = "no result" if best is None else \
            ("earns its place" if best >= PASS_THRESHOLD else f"saves under {PASS_THRESHOLD:g}%: remove it")
        shown = ", ".join(f"{s} {d:+.2f}%" for s, d in diffs.items())
        body.append(f"- {switch}: {shown} -> {verdict}")
    return body


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--run-ours":  # the child: switch, then pretrain_gpt.py
        switch, rest = sys.argv[2], sys.argv[3:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        if switch != "none":
            turn_off(switch)
        run_ours_wrapper(rest)
        return
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="124m,1.3b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--switches", default=",".join(SWITCHES), help=f"comma list of {', '.join(SWITCHES)}")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every variant (order reversed every other)")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations per run (CUDA-graph capture included)")
    ap.add_argument("--budget-s", type=float, default=380.0,
                    help="start a round after the first only if it should end within this many seconds of the start")
    ap.add_argument("--data-prefix", default=None, help=".bin/.idx prefix (default: tokenise the bundled corpus)")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--log-dir", default=None, help="where to keep every run's full log")
    a = ap.parse_args()
    shapes = comma_choices("--shapes", a.shapes, SHAPES)
    switches = comma_choices("--switches", a.switches, SWITCHES)
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {a.rounds}")
    if a.data_prefix and not (os.path.exists(a.data_prefix + ".bin") and os.path.exists(a.data_prefix + ".idx")):
        raise SystemExit(f"--data-prefix {a.data_prefix}: expected {a.data_prefix}.bin and {a.data_prefix}.idx")
    skipped = {s: unavailable_reason(s) for s in switches if unavailable_reason(s)}
    variants = [ALL_ON] + [f"{s} off" for s in switches if s not in skipped]
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    meta = run_meta("switch_ab.py")
    data_prefix = a.data_prefix or prepare_dataset(tempfile.mkdtemp(prefix="switch_ab_data_"))
    runs, rounds_done, round_s = [], 0, None
    for r in range(a.rounds):
        if round_s is not None and time.time() - start + round_s > a.budget_s:
            print(f"round {r + 1} skipped: it would end after --budget-s {a.budget_s:g}", flush=True)
            break
        t_round = time.time()
        order = variants if r % 2 == 0 else variants[::-1]
        for shape in shapes:
            for variant in order:
                switch = None if variant == ALL_ON else variant[:-len(" off")]
                log = os.path.join(a.log_dir, f"{shape}_{variant.replace(' ', '_')}_{r + 1}.log") if a.log_dir \
                    else None
                res = run_one(shape, switch, a.iters, a.warmup, data_prefix, log)
                runs.append({"shape": shape, "variant": variant, "round": r + 1, **res})
                print(f"round {r + 1} | {shape} | {variant}: median {res['median_ms']:.2f} ms/iter "
                      f"({res['wall_s']:.0f} s)", flush=True)
        rounds_done, round_s = r + 1, time.time() - t_round
    rows = summarise(runs, shapes, variants)
    for row in rows:
        row["runs"] = [{k: v for k, v in run.items() if k not in ("shape", "variant")}
                       for run in runs if run["shape"] == row["shape"] and run["variant"] == row["variant"]]
    body = markdown(rows, skipped, rounds_done, a)
    body += ["", "Runs (all on; a variant adds its switch off in the child process, `bench/switch_ab.py --run-ours "
             "SWITCH -- pretrain_gpt.py ...`):", ""]
    body += [f"- {shape}: `{next(r['command'] for r in runs if r['shape'] == shape)}`" for shape in shapes]
    body += ["", f"Total time: {time.time() - start:.0f} s."]
    write_results(a.results_dir, "switch_ab", meta, rows, "Speed switches, each on and off", body)
    print("\n".join(body), flush=True)


if __name__ == "__main__":
    main()
