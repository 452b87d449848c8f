"""The planner's predictions against measurement: peak memory (+-10%) and iteration time (+-15%).

Modes:

    python bench/plan_validation.py --run --calibrate-first --results-dir DIR   # on one GPU, about 6 minutes
        1. tools/plan.py --calibrate writes the measured calibration to DIR/h200.json;
        2. every configuration runs as its own process (pretrain_gpt.py / pretrain_bert.py on the bundled corpus,
           WARMUP + ITERS iterations); its ms/iteration (the log lines after the warm-up) and its allocator
           peak are appended to DIR/plan_measurements.json;
        3. after every configuration the comparison is written again: DIR/plan_validation.{json,md}, predicted
           with the measured calibration (the top-level columns) and with the shipped one.
        A run cut short keeps the rows it finished. --tiny runs the same path with tiny shapes on the CPU.
    python bench/plan_validation.py --from-measurements DIR/plan_measurements.json [--calibration FILE ...]
        # anywhere: predict saved measurements again (after a change of the memory or time model)
    python bench/plan_validation.py --from-records    # the runs recorded earlier in bench/results
    python bench/plan_validation.py --run-one -- pretrain_gpt.py FLAGS   # one run, printing PLAN_MEM peaks

BERT rows need a WordPiece vocabulary: --bert-vocab-file, the BERT_VOCAB_FILE variable or ../shared/data/bert;
without one, a vocabulary is trained on the bundled corpus with ``tokenizers`` (its size goes to the planner).
Triton kernels compile on the first process that needs them and are cached on disk (~/.triton/cache, or
TRITON_CACHE_DIR) for the next ones; the compilation falls inside the warm-up iterations, never the timed ones.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from megatron.core.planner import load_calibration  # noqa: E402
from megatron.training.plan_validation import compare, load_measurements, markdown, summary  # noqa: E402

DROPOUT_OFF = "--attention-dropout 0.0 --hidden-dropout 0.0"
COMMON = (f"--bf16 {DROPOUT_OFF} --cross-entropy-loss-fusion "
          "--make-vocab-size-divisible-by 128")
GPT_124M = "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024"
GPT_1B3 = "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048"
BERT_LARGE = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
              "--max-position-embeddings 512")
SEL = "--recompute-granularity selective"
SEL_12 = f"{SEL} --recompute-modules mlp_act --recompute-num-layers 12"
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
FP8 = "--fp8-format hybrid"


def _mb(mb: int, gbs: int) -> str:
    return f"--micro-batch-size {mb} --global-batch-size {gbs}"


def full_flags(flags: str) -> str:
    """A configuration's flags followed by COMMON; one that sets its own dropout keeps it (COMMON's dropout-off
    flags, which would come last and win, are left out for it)."""
    common = COMMON.replace(DROPOUT_OFF + " ", "") if "-dropout " in flags else COMMON
    return f"{flags} {common}"


DROPOUT = "--attention-dropout 0.1 --hidden-dropout 0.1"


# (name, entry point, GPUs, flags): GPT 124M and 1.3B, BERT-large; none / selective / full recomputation; bf16 and
# FP8; micro-batch 1-8. Ordered so that a run cut short by its time budget still covers every kind; the order does
# not change what compiles (each shape's Triton kernels compile in its first process and are cached on disk)
CONFIGS = [
    ("gpt124m_mb1_none", "pretrain_gpt.py", 1, f"{GPT_124M} {_mb(1, 4)}"),
    ("bert_large_mb8_none", "pretrain_bert.py", 1, f"{BERT_LARGE} {_mb(8, 16)}"),
    ("gpt1.3b_mb8_selective", "pretrain_gpt.py", 1, f"{GPT_1B3} {_mb(8, 8)} {SEL}"),
    ("gpt124m_mb8_none_fp8", "pretrain_gpt.py", 1, f"{GPT_124M} {_mb(8, 8)} {FP8}"),
    ("bert_large_mb4_selective", "pretrain_bert.py", 1, f"{BERT_LARGE} {_mb(4, 8)} {SEL}"),
    ("gpt1.3b_mb8_full", "pretrain_gpt.py", 1, f"{GPT_1B3} {_mb(8, 8)} {FULL}"),
    ("gpt124m_mb8_full", "pretrain_gpt.py", 1, f"{GPT_124M} {_mb(8, 8)} {FULL}"),
    ("gpt1.3b_mb4_none_fp8", "pretrain_gpt.py", 1, f"{GPT_1B3} {_mb(4, 8)} {FP8}"),
    ("gpt124m_mb4_none", "pretrain_gpt.py", 1, f"{GPT_124M} {_mb(4, 8)}"),
    ("bert_large_mb8_full", "pretrain_bert.py", 1, f"{BERT_LARGE} {_mb(8, 8)} {FULL}"),
    ("gpt1.3b_mb2_none", "pretrain_gpt.py", 1, f"{GPT_1B3} {_mb(2, 4)}"),
    ("gpt124m_mb8_selective", "pretrain_gpt.py", 1, f"{GPT_124M} {_mb(8, 16)} {SEL}"),
    ("gpt1.3b_mb8_sel12_fp8", "pretrain_gpt.py", 1, f"{GPT_1B3} {_mb(8, 8)} {SEL_12} {FP8}"),
    ("gpt124m_mb2_selective_fp8", "pretrain_gpt.py", 1, f"{GPT_124M} {_mb(2, 8)} {SEL} {FP8}"),
    # dropout 0.1 (no results yet): the fused bias-dropout-add keeps no mask, PyTorch's dropout a 1-byte one
    ("gpt124m_mb8_none_dropout", "pretrain_gpt.py", 1, f"{GPT_124M} {_mb(8, 8)} {DROPOUT}"),
    ("gpt124m_mb4_none_dropout_unfused", "pretrain_gpt.py", 1,
     f"{GPT_124M} {_mb(4, 8)} {DROPOUT} --no-bias-dropout-fusion --attention-backend unfused"),
    ("gpt1.3b_mb8_selective_dropout", "pretrain_gpt.py", 1, f"{GPT_1B3} {_mb(8, 8)} {SEL} {DROPOUT}"),
    ("bert_large_mb8_none_dropout", "pretrain_bert.py", 1, f"{BERT_LARGE} {_mb(8, 16)} {DROPOUT}"),
]

# --tiny: the same configurations' kinds at tiny shapes, to check the whole path on a CPU
GPT_TINY = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32"
BERT_TINY = GPT_TINY
TINY = [
    ("tiny_gpt_mb1_none", "pretrain_gpt.py", 1, f"{GPT_TINY} {_mb(1, 2)}"),
    ("tiny_gpt_mb2_selective", "pretrain_gpt.py", 1, f"{GPT_TINY} {_mb(2, 4)} {SEL}"),
    ("tiny_gpt_mb2_full", "pretrain_gpt.py", 1, f"{GPT_TINY} {_mb(2, 2)} {FULL}"),
    ("tiny_bert_mb2_none", "pretrain_bert.py", 1, f"{BERT_TINY} {_mb(2, 2)}"),
]

# measurements recorded earlier (file under bench/, config, GPUs, flags, ms/iter, peak GiB); runs whose flags have
# no row in the current throughput table are kept, with their provenance, in results/plan_records.md
RECORDS = [
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_none", 1, f"{GPT_1B3} {_mb(8, 8)}", 252.8, 47.9),
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_selective", 1, f"{GPT_1B3} {_mb(8, 8)} {SEL}", 262.9, 41.9),
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_sel_mlp_act", 1,
     f"{GPT_1B3} {_mb(8, 8)} {SEL} --recompute-modules mlp_act", 256.6, 41.9),
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_full_uniform", 1, f"{GPT_1B3} {_mb(8, 8)} {FULL}",
     325.1, 25.4),
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_full_block12", 1, f"{GPT_1B3} {_mb(8, 8)} "
     "--recompute-granularity full --recompute-method block --recompute-num-layers 12", 288.2, 36.6),
    ("results/plan_records.md", "gpt1.3b_mb8_sel12", 1, f"{GPT_1B3} {_mb(8, 8)} {SEL_12}",
     266.0, 44.9),
    ("results/plan_records.md", "gpt1.3b_mb8_sel12_fp8", 1,
     f"{GPT_1B3} {_mb(8, 8)} {SEL_12} {FP8}", 224.0, 45.2),
    ("results/multi_gpu.md", "gpt1.3b_dp2_distopt", 2, f"{GPT_1B3} {_mb(8, 16)} {SEL_12} "
     "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather", 265.3, 37.5),
    ("results/multi_gpu.md", "gpt1.3b_tp2_sp", 2, f"{GPT_1B3} {_mb(8, 8)} "
     "--tensor-model-parallel-size 2 --sequence-parallel", 164.5, 27.1),
    ("results/plan_records.md", "gpt124m_mb16_none_cuda_graph", 1,
     f"{GPT_124M} {_mb(16, 16)} --enable-cuda-graph", 34.5, 8.3),
    ("results/plan_records.md", "gpt124m_mb16_none_fp8_cuda_graph", 1,
     f"{GPT_124M} {_mb(16, 16)} {FP8} --enable-cuda-graph", 33.4, 7.7),
    ("results/multi_gpu.md", "gpt1.3b_pp2", 2, f"{GPT_1B3} {_mb(4, 32)} --pipeline-model-parallel-size 2",
     584.9, 24.2),
]
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def from_records(calibration: dict) -> list:
    """The comparison for the runs recorded in bench/results (in-sample for the shipped calibration)."""
    recs = []
    for source, config, gpus, flags, ms, gib in RECORDS:
        full = full_flags(flags)
        launch = f" (torchrun --nproc_per_node {gpus})" if gpus > 1 else ""
        recs.append({"config": config, "planner_flags": full, "gpus": gpus, "measured_ms_per_iter": ms,
                     "measured_peak_mem_gib": gib, "source": f"bench/{source}",
                     "command": f"pretrain_gpt.py {full}{launch}"})
    return compare(recs, {"shipped": calibration})


# ---- measuring -------------------------------------------------------------------------------------------
def run_one(argv: list) -> None:
    """Run a trainer entry point in this process; at exit print its allocator peak, reserved peak and the device
    memory used outside the allocator (CUDA context, cuBLAS workspaces, NCCL buffers)."""
    import atexit
    import runpy

    import torch

    def report():
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            outside = total - free - torch.cuda.memory_reserved()
            print(f"PLAN_MEM allocated {torch.cuda.max_memory_allocated()} reserved "
                  f"{torch.cuda.max_memory_reserved()} outside {outside}", flush=True)

    atexit.register(report)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def _peaks(text: str) -> dict:
    found = [tuple(int(x) for x in m) for m in re.findall(r"PLAN_MEM allocated (\d+) reserved (\d+) outside (-?\d+)",
                                                         text)]
    if not found:
        return {}
    alloc, reserved, outside = (max(f[i] for f in found) for i in range(3))
    return {"allocated": alloc / 2 ** 30, "reserved": reserved / 2 ** 30, "outside": outside / 2 ** 30}


def train_bert_vocab(workdir: str, size: int = 30522) -> str:
    """A lower-case WordPiece vocabulary trained on the bundled corpus, filled up to BERT's ``size`` entries with
    ``[unusedN]`` tokens (as BERT's own vocabulary has them) so that the model has BERT-large's embedding shape."""
    from tokenizers import BertWordPieceTokenizer

    with gzip.open(os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "rt") as f:
        docs = [json.loads(line)["text"] for line in f]
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(docs, vocab_size=size, special_tokens=BERT_SPECIAL, show_progress=False)
    path = tok.save_model(workdir, "corpus")[0]
    with open(path) as f:
        trained = sum(1 for line in f if line.strip())
    with open(path, "a") as f:
        f.writelines(f"[unused{i}]\n" for i in range(size - trained))
    return path


def bert_vocab_size(vocab_file: str) -> int:
    from megatron.core.tokenizer import build_tokenizer

    return build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_file).vocab_size


class Runner:
    """Runs configurations one process each; data is prepared once, on first need."""

    def __init__(self, workdir: str, log_dir: str, iters: int, warmup: int, bert_vocab: str,
                 bert_prefix: str = None):
        self.workdir, self.log_dir, self.iters, self.warmup = workdir, log_dir, iters, warmup
        self.bert_vocab = bert_vocab
        self.gpt_prefix = self.bert_error = None
        self.bert_prefix = bert_prefix

    def _data(self, entry: str) -> tuple:
        """(data flags, planner flags) of an entry point; tokenises the bundled corpus the first time."""
        from corpus import SEED, SPLIT, data_flags, prepare_bert_dataset, prepare_dataset

        if entry == "pretrain_gpt.py":
            self.gpt_prefix = self.gpt_prefix or prepare_dataset(self.workdir)
            return data_flags(self.gpt_prefix), ""
        if self.bert_error:  # the BERT data could not be made once: do not try again for every row
            raise RuntimeError(self.bert_error)
        try:
            if not self.bert_vocab:
                print("training a WordPiece vocabulary on the bundled corpus (no --bert-vocab-file)", flush=True)
                self.bert_vocab = train_bert_vocab(self.workdir)
            self.bert_prefix = self.bert_prefix or prepare_bert_dataset(self.workdir, self.bert_vocab)
        except (ImportError, OSError, subprocess.SubprocessError) as exc:
            self.bert_error = f"BERT data not prepared: {exc}"
            raise RuntimeError(self.bert_error) from None
        flags = (f"--data-path {self.bert_prefix} --vocab-file {self.bert_vocab} --tokenizer-type "
                 f"BertWordPieceLowerCase --split {SPLIT} --seed {SEED}")
        return flags, f" --model bert --vocab-size {bert_vocab_size(self.bert_vocab)}"

    def measure(self, name: str, entry: str, gpus: int, flags: str, timeout_s: float) -> dict:
        """One configuration: its measurement record (module doc of megatron/core/planner/validation.py)."""
        from gpu_throughput import parse_ours_log

        t0 = time.perf_counter()
        full = full_flags(flags)
        data, planner_extra = self._data(entry)
        run = f"{full} --train-iters {self.iters + self.warmup} {data} --lr 1e-4 --eval-iters 0 --log-interval 1"
        launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                       f"--nproc_per_node={gpus}"]
        cmd = launcher + [os.path.abspath(__file__), "--run-one", "--", os.path.join(ROOT, entry)] + shlex.split(run)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
            code = f"timeout after {timeout_s:.0f} s"
        with open(os.path.join(self.log_dir, f"{name}.log"), "w") as f:
            f.write(text)
        if code != 0:
            raise RuntimeError(f"exit {code}; see {os.path.join(self.log_dir, name + '.log')}")
        res, peaks = parse_ours_log(text, self.warmup), _peaks(text)
        return {"config": name, "command": f"{entry} {full}", "planner_flags": full + planner_extra, "gpus": gpus,
                "measured_ms_per_iter": round(res["ms_per_iter"], 1),
                "measured_peak_mem_gib": round(peaks["allocated"], 2) if peaks else None,
                "measured_reserved_gib": round(peaks["reserved"], 2) if peaks else None,
                "outside_allocator_gib": round(peaks["outside"], 2) if peaks else None,
                "iter_ms": [round(x, 1) for x in res["iter_ms"]], "wall_s": round(time.perf_counter() - t0, 1),
                "source": "measured by this run"}


def calibrate_first(results_dir: str, tiny: bool, timeout_s: float) -> str:
    """tools/plan.py --calibrate into ``results_dir/h200.json`` (``cpu.json`` under --tiny); its path."""
    out = os.path.join(results_dir, "cpu.json" if tiny else "h200.json")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--calibrate", "--calibration-out", out]
    cmd += ["--calibrate-device", "cpu", "--quick"] if tiny else []
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=timeout_s)
    print(f"calibration: {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _write(out: str, measurements: list, calibrations: dict, meta: dict, command: str, title: str, notes) -> list:
    """Predict ``measurements`` with every calibration (label -> kind or file); write ``out``.json and ``out``.md
    and return the rows."""
    cals = {label: load_calibration(path) for label, path in calibrations.items()}
    rows = compare(measurements, cals)
    paths = {label: os.path.relpath(c["_path"], ROOT) if c["_path"].startswith(ROOT) else c["_path"]
             for label, c in cals.items()}
    notes = list(notes) + fitted_notes(cals)
    with open(out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(rows, title, paths, command, notes=[f"{k}: {v}" for k, v in meta.items()] + notes))
    return rows


def fitted_notes(cals: dict) -> list:
    """One line per calibration whose ``derivation`` marks entries as fitted to validation runs (in-sample)."""
    out = []
    for label, cal in cals.items():
        derivation = cal.get("derivation")
        fitted = [k for k, v in derivation.items() if str(v).startswith("IN-SAMPLE")] \
            if isinstance(derivation, dict) else []
        if fitted:
            out.append(f"In-sample: calibration `{label}` has {', '.join(fitted)} fitted to validation runs (its "
                       "'derivation' names them); where those are the runs of this table, the rows they were fitted "
                       "on show the fit, not the accuracy on new configurations.")
    return out


def _progress(row: dict) -> str:
    """``measured 12.3 ms, 4.5 GiB | calibrated -3.1% time, +1.2% memory | shipped ...``"""
    pct = lambda p, key: f"{100 * p[key]:+.1f}%" if key in p else "n/a"  # noqa: E731
    preds = row.get("by_calibration") or {"predicted": row}
    return (f"measured {row['measured_ms_per_iter']} ms, {row['measured_peak_mem_gib']} GiB | " + " | ".join(
        f"{label} {p['predicted_ms_per_iter']} ms ({pct(p, 'time_error')}), {p['predicted_peak_mem_gib']} GiB "
        f"({pct(p, 'mem_error')})" for label, p in preds.items()))


def run_all(args, command: str) -> None:
    os.makedirs(args.results_dir, exist_ok=True)
    log_dir = os.path.join(args.results_dir, "plan_validation_logs")
    os.makedirs(log_dir, exist_ok=True)
    configs = TINY if args.tiny else CONFIGS
    only = set(filter(None, args.only.split(",")))
    unknown = only - {c[0] for c in configs}
    if unknown:
        raise SystemExit(f"error: --only names no configuration: {', '.join(sorted(unknown))}")
    start = time.perf_counter()
    calibrations = {}
    if args.calibrate_first:
        try:
            calibrations["calibrated"] = calibrate_first(args.results_dir, args.tiny, 90 if not args.tiny else 300)
        except (subprocess.SubprocessError, OSError) as exc:
            print(f"calibration failed ({exc}); predicting with the shipped calibration only", flush=True)
    calibrations["shipped"] = args.calibration
    import torch

    meta = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "iterations": f"{args.warmup} warm-up + {args.iters} timed (ms/iteration: the mean of the timed ones)"}
    runner = Runner(tempfile.mkdtemp(prefix="plan_validation_"), log_dir, args.iters, args.warmup,
                    args.bert_vocab_file, args.bert_data_prefix)
    out = os.path.join(args.results_dir, "plan_validation")
    measurements, skipped = [], []
    title = "Planner against measurement" + (" (tiny shapes on the CPU: checks the machinery)" if args.tiny else "")
    for name, entry, gpus, flags in configs:
        if only and name not in only:
            continue
        left = args.budget_s - (time.perf_counter() - start)
        if left < args.min_config_s:
            skipped.append(name)
            print(f"{name}: skipped, {left:.0f} s left of --budget-s {args.budget_s:g}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            # killed past the budget plus a margin, so the whole command ends within --budget-s + 40 s
            rec = runner.measure(name, entry, gpus, flags, min(args.config_timeout_s, left + 40))
        except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
            skipped.append(name)
            print(f"{name}: FAILED ({exc})", flush=True)
            continue
        measurements.append(rec)
        with open(os.path.join(args.results_dir, "plan_measurements.json"), "w") as f:
            json.dump({"meta": meta, "measurements": measurements}, f, indent=1)
        notes = [f"not measured: {', '.join(skipped)}"] if skipped else []
        rows = _write(out, measurements, calibrations, meta, command, title, notes)
        print(f"[{time.perf_counter() - start:5.0f} s] {name}: {time.perf_counter() - t0:.0f} s wall | "
              + _progress(rows[-1]), flush=True)
    if not measurements:
        raise SystemExit("error: no configuration was measured; see the logs in " + log_dir)
    rows = _write(out, measurements, calibrations, meta, command, title,
                  [f"not measured: {', '.join(skipped)}"] if skipped else [])
    print(f"done in {time.perf_counter() - start:.0f} s: {summary(rows)}; {out}.md", flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--run-one":
        run_one(sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--run", action="store_true", help="measure every configuration on this machine, then compare")
    mode.add_argument("--from-measurements", metavar="FILE", help="compare a saved plan_measurements.json again")
    mode.add_argument("--from-records", action="store_true", help="compare with the runs recorded in bench/results")
    ap.add_argument("--calibration", default="h200",
                    help="the shipped calibration (GPU kind) or a JSON file; with --from-measurements repeat "
                         "LABEL=FILE pairs comma-separated, e.g. calibrated=out/h200.json,shipped=h200")
    ap.add_argument("--calibrate-first", action="store_true",
                    help="--run: first run tools/plan.py --calibrate into RESULTS_DIR/h200.json and predict with it "
                         "too")
    ap.add_argument("--tiny", action="store_true", help="--run: tiny shapes on the CPU (checks the whole path)")
    ap.add_argument("--only", default="", help="--run: comma-separated configuration names")
    vocab = os.path.join(os.path.dirname(ROOT), "shared", "data", "bert", "vocab.txt")
    ap.add_argument("--bert-vocab-file",
                    default=os.environ.get("BERT_VOCAB_FILE", vocab if os.path.exists(vocab) else ""),
                    help="WordPiece vocab.txt for the BERT rows (default: ../shared/data/bert/vocab.txt when present, "
                         "else one trained on the bundled corpus)")
    ap.add_argument("--bert-data-prefix", default=None,
                    help="an already tokenised _text_sentence prefix for the BERT rows (made with --bert-vocab-file); "
                         "default: the bundled corpus split into sentences here, which needs nltk")
    ap.add_argument("--note", action="append", default=[],
                    help="--from-measurements: a line of text for the report (repeatable)")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations first (Triton compilation falls here)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="--run: stop starting configurations when less than --min-config-s of this is left")
    ap.add_argument("--min-config-s", type=float, default=25.0, help="time one configuration is expected to need")
    ap.add_argument("--config-timeout-s", type=float, default=150.0, help="a configuration running longer is killed")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"),
                    help="where plan_validation.{json,md}, plan_measurements.json, the logs and the measured "
                         "calibration go")
    args = ap.parse_args()
    command = "python bench/plan_validation.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.bert_vocab_file and not os.path.exists(args.bert_vocab_file):
        raise SystemExit(f"error: --bert-vocab-file {args.bert_vocab_file}: no such file")
    try:
        if args.run:
            run_all(args, command)
        elif args.from_measurements:
            measurements = load_measurements(args.from_measurements)
            with open(args.from_measurements) as f:
                data = json.load(f)
            meta = {f"measured {k}": v for k, v in data.get("meta", {}).items()} if isinstance(data, dict) else {}
            pairs = [p.split("=", 1) if "=" in p else [os.path.basename(p).removesuffix(".json"), p]
                     for p in args.calibration.split(",") if p]
            os.makedirs(args.results_dir, exist_ok=True)
            out = os.path.join(args.results_dir, "plan_validation")
            rows = _write(out, measurements, dict(pairs), meta, command,
                          f"Planner against the measurements of {args.from_measurements}", args.note)
            print(f"{summary(rows)}; {out}.md")
        else:
            out = os.path.join(args.results_dir, "plan_validation_records")
            cal = load_calibration(args.calibration)
            rows = from_records(cal)
            notes = ["In-sample in part: the calibration's carried-over entries (fixed overheads, intra-node "
                     "collective rates) were fitted on these recorded runs; its measured rates and host entries "
                     "were not. `--run` measures fresh configurations."]
            with open(out + ".json", "w") as f:
                json.dump(rows, f, indent=1)
            with open(out + ".md", "w") as f:
                f.write(markdown(rows, "Planner against the runs recorded in bench/results",
                                 {"shipped": os.path.relpath(cal["_path"], ROOT)}, command, notes))
            print(f"{summary(rows)}; {out}.md")
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
