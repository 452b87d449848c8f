"""The planner's predictions against measurement: peak memory (+-10%) and iteration time (+-15%).

Two modes:

    python bench/plan_validation.py --run [--only NAME,...]   # on the GPU: run every configuration with
        pretrain_gpt.py (through bench/gpu_throughput.py --run-ours, which prints the peak allocated memory),
        read ms/iteration from the log and peak memory, and write bench/results/plan_validation.{json,md}
    python bench/plan_validation.py --run-one -- pretrain_gpt.py FLAGS   # one run, printing PLAN_MEM peaks
    python bench/plan_validation.py --from-records            # anywhere: the same comparison for the runs
        already recorded in bench/results (the measurements the shipped H200 calibration was derived from)

Each row: config, command, predicted_peak_mem_gib, measured_peak_mem_gib, predicted_ms_per_iter,
measured_ms_per_iter, the two relative errors and whether each is within its tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.core.planner import load_calibration, predict  # noqa: E402
from megatron.core.planner.flags import inputs_from_argv  # noqa: E402

MEM_TOL, TIME_TOL = 0.10, 0.15
COMMON = ("--bf16 --attention-dropout 0.0 --hidden-dropout 0.0 --cross-entropy-loss-fusion "
          "--make-vocab-size-divisible-by 128")
GPT_124M = "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024"
GPT_1B3 = "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048"
BERT_LARGE = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
              "--max-position-embeddings 512")
SEL_12 = "--recompute-granularity selective --recompute-modules mlp_act --recompute-num-layers 12"

# (name, entry point, GPUs, flags): GPT 124M and 1.3B, BERT-large; none/selective/full; bf16 and FP8; micro 1-8
CONFIGS = [
    ("gpt124m_mb8_none", "pretrain_gpt.py", 1, f"{GPT_124M} --micro-batch-size 8 --global-batch-size 32"),
    ("gpt124m_mb1_none", "pretrain_gpt.py", 1, f"{GPT_124M} --micro-batch-size 1 --global-batch-size 8"),
    ("gpt124m_mb4_selective_fp8", "pretrain_gpt.py", 1,
     f"{GPT_124M} --micro-batch-size 4 --global-batch-size 16 --recompute-granularity selective --fp8-format hybrid"),
    ("gpt1.3b_mb8_none", "pretrain_gpt.py", 1, f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8"),
    ("gpt1.3b_mb8_selective", "pretrain_gpt.py", 1,
     f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 --recompute-granularity selective"),
    ("gpt1.3b_mb8_full_uniform", "pretrain_gpt.py", 1, f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 "
     "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
    ("gpt1.3b_mb8_full_block12", "pretrain_gpt.py", 1, f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 "
     "--recompute-granularity full --recompute-method block --recompute-num-layers 12"),
    ("gpt1.3b_mb8_sel12_fp8", "pretrain_gpt.py", 1,
     f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 {SEL_12} --fp8-format hybrid"),
    ("gpt1.3b_mb2_none_fp8", "pretrain_gpt.py", 1,
     f"{GPT_1B3} --micro-batch-size 2 --global-batch-size 16 --fp8-format hybrid"),
    ("gpt1.3b_mb4_full_uniform", "pretrain_gpt.py", 1, f"{GPT_1B3} --micro-batch-size 4 --global-batch-size 16 "
     "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"),
    ("bert_large_mb8_none", "pretrain_bert.py", 1, f"{BERT_LARGE} --micro-batch-size 8 --global-batch-size 32"),
    ("bert_large_mb8_selective", "pretrain_bert.py", 1,
     f"{BERT_LARGE} --micro-batch-size 8 --global-batch-size 32 --recompute-granularity selective"),
]

# a tiny configuration that checks the --run machinery anywhere, CPU included (--smoke)
SMOKE = [("gpt_tiny_smoke", "pretrain_gpt.py", 1, "--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
          "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4")]

# measurements recorded earlier (file under bench/, config, GPUs, flags, ms/iter, peak GiB); the runs of
# earlier source versions are kept in bench/experiments/results
RECORDS = [
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_none", 1, f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8",
     252.8, 47.9),
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_selective", 1,
     f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 --recompute-granularity selective", 262.9, 41.9),
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_sel_mlp_act", 1,
     f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 --recompute-granularity selective "
     "--recompute-modules mlp_act", 256.6, 41.9),
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_full_uniform", 1,
     f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 1", 325.1, 25.4),
    ("results/gpu_throughput_recompute.md", "gpt1.3b_mb8_full_block12", 1,
     f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 --recompute-granularity full --recompute-method block "
     "--recompute-num-layers 12", 288.2, 36.6),
    ("experiments/results/gpu_throughput_final_check.md", "gpt1.3b_mb8_sel12", 1,
     f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 {SEL_12}", 266.0, 44.9),
    ("experiments/results/gpu_throughput_fp8_sweep.md", "gpt1.3b_mb8_sel12_fp8", 1,
     f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 {SEL_12} --fp8-format hybrid", 224.0, 45.2),
    ("results/multi_gpu.md", "gpt1.3b_dp2_distopt", 2, f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 16 {SEL_12} "
     "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather", 265.3, 37.5),
    ("results/multi_gpu.md", "gpt1.3b_tp2_sp", 2, f"{GPT_1B3} --micro-batch-size 8 --global-batch-size 8 "
     "--tensor-model-parallel-size 2 --sequence-parallel", 164.5, 27.1),
    ("experiments/results/gpu_throughput_fp8_sweep.md", "gpt124m_mb16_none_cuda_graph", 1,
     f"{GPT_124M} --micro-batch-size 16 --global-batch-size 16 --enable-cuda-graph", 34.5, 8.3),
    ("experiments/results/gpu_throughput_fp8_sweep.md", "gpt124m_mb16_none_fp8_cuda_graph", 1,
     f"{GPT_124M} --micro-batch-size 16 --global-batch-size 16 --fp8-format hybrid --enable-cuda-graph", 33.4, 7.7),
    ("results/multi_gpu.md", "gpt1.3b_pp2", 2, f"{GPT_1B3} --micro-batch-size 4 --global-batch-size 32 "
     "--pipeline-model-parallel-size 2", 584.9, 24.2),
]


def predicted(flags: str, gpus: int, calibration: dict) -> dict:
    shape, layout, cluster, gbs = inputs_from_argv(shlex.split(flags), num_gpus=gpus)
    pred = predict(shape, layout, cluster, calibration, gbs)
    return {"predicted_peak_mem_gib": round(pred.peak_bytes / 2 ** 30, 2),
            "predicted_ms_per_iter": round(pred.ms_per_iter, 1)}


def make_row(config: str, command: str, pred: dict, ms: float, gib: float, source: str) -> dict:
    row = {"config": config, "command": command, **pred, "measured_peak_mem_gib": gib, "measured_ms_per_iter": ms,
           "source": source}
    if gib:
        row["mem_error"] = round(pred["predicted_peak_mem_gib"] / gib - 1, 4)
        row["mem_within_10pct"] = abs(row["mem_error"]) <= MEM_TOL
    if ms:
        row["time_error"] = round(pred["predicted_ms_per_iter"] / ms - 1, 4)
        row["time_within_15pct"] = abs(row["time_error"]) <= TIME_TOL
    return row


def from_records(calibration: dict) -> list:
    rows = []
    for source, config, gpus, flags, ms, gib in RECORDS:
        cmd = f"pretrain_gpt.py {flags} {COMMON}" + (f" (torchrun --nproc_per_node {gpus})" if gpus > 1 else "")
        rows.append(make_row(config, cmd, predicted(f"{flags} {COMMON}", gpus, calibration), ms, gib,
                             f"bench/{source}"))
    return rows


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


def prepare_bert_dataset(workdir: str, vocab: str) -> str:
    """The bundled corpus split into sentences and WordPiece-tokenised (what pretrain_bert.py reads)."""
    import gzip
    import shutil

    prefix = os.path.join(workdir, "bert_text_sentence")
    if os.path.exists(prefix + ".bin"):
        return prefix
    jsonl = os.path.join(workdir, "bert_corpus.jsonl")
    with gzip.open(os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "rb") as fin, open(jsonl, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
                    "--output-prefix", os.path.join(workdir, "bert"), "--tokenizer-type", "BertWordPieceLowerCase",
                    "--vocab-file", vocab, "--split-sentences", "--workers", "4"], check=True, cwd=ROOT)
    return prefix


def run_all(calibration: dict, only, iters: int, warmup: int, log_dir: str, bert_vocab: str, configs=None) -> list:
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from corpus import SEED, SPLIT, data_flags, prepare_dataset  # the benchmark's data
    from gpu_throughput import parse_ours_log  # and log parsing

    workdir = tempfile.mkdtemp(prefix="plan_validation_")
    data = prepare_dataset(workdir)
    rows = []
    for name, entry, gpus, flags in configs or CONFIGS:
        if only and name not in only:
            continue
        full = f"{flags} {COMMON}"
        if not os.path.exists(os.path.join(ROOT, entry)):
            print(f"{name}: {entry} is not in this checkout; row not measured", flush=True)
            continue
        if entry == "pretrain_bert.py" and not (bert_vocab and os.path.exists(bert_vocab)):
            print(f"{name}: needs a BERT WordPiece vocabulary (--bert-vocab-file); row not measured", flush=True)
            continue
        if entry == "pretrain_bert.py":  # WordPiece vocabulary: --bert-vocab-file or the BERT_VOCAB_FILE variable
            prefix = prepare_bert_dataset(workdir, bert_vocab)
            source = (f"--data-path {prefix} --vocab-file {bert_vocab} --tokenizer-type BertWordPieceLowerCase "
                      f"--split {SPLIT} --seed {SEED}")
        else:  # the GPT data flags of every throughput benchmark (bench/corpus.py)
            source = data_flags(data)
        run = f"{full} --train-iters {iters + warmup} {source} --lr 1e-4 --eval-iters 0 --log-interval 1"
        launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                       f"--nproc_per_node={gpus}"]
        cmd = launcher + [os.path.join(ROOT, "bench", "plan_validation.py"), "--run-one", "--",
                          os.path.join(ROOT, entry)] + shlex.split(run)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        with open(os.path.join(log_dir, f"{name}.log"), "w") as f:
            f.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"{name}: exit {proc.returncode}; see {log_dir}/{name}.log", flush=True)
            continue
        res = parse_ours_log(proc.stdout + proc.stderr, warmup)
        peaks = _peaks(proc.stdout + proc.stderr)
        model = " --model bert" if entry == "pretrain_bert.py" else ""
        row = make_row(name, f"{entry} {full}", predicted(full + model, gpus, calibration), round(res["ms_per_iter"], 1),
                       round(peaks["allocated"], 2) if peaks else None, "measured by this run")
        if peaks:
            row.update(measured_reserved_gib=round(peaks["reserved"], 2),
                       outside_allocator_gib=round(peaks["outside"], 2))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows: list, title: str, calibration: dict, command: str) -> str:
    ok_mem = sum(1 for r in rows if r.get("mem_within_10pct"))
    ok_time = sum(1 for r in rows if r.get("time_within_15pct"))
    out = [f"# {title}", "", f"Command: `{command}`; calibration `{os.path.relpath(calibration['_path'], ROOT)}`.",
           f"Memory within +-10%: {ok_mem}/{len(rows)}; time within +-15%: {ok_time}/{len(rows)}.", ""]
    if any(r["source"].startswith(("bench/results/", "bench/experiments/")) for r in rows):
        out += ["In-sample: the calibration's fitted entries (overheads, element-wise and intra-node collective rates) "
                "were chosen on these recorded runs, so this table shows the model's fit, not its accuracy on new "
                "configurations; `--run` measures fresh configurations for that.", ""]
    out += ["| config | predicted peak GiB | measured peak GiB | error | predicted ms/iter | measured ms/iter | "
           "error | source |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pct = lambda key: f"{100 * r[key]:+.1f}%" if key in r else "n/a"  # noqa: E731
        out.append(f"| {r['config']} | {r['predicted_peak_mem_gib']} | {r['measured_peak_mem_gib'] or 'n/a'} | "
                   f"{pct('mem_error')} | {r['predicted_ms_per_iter']} | {r['measured_ms_per_iter']} | "
                   f"{pct('time_error')} | {r['source']} |")
    ratios = sorted(r["measured_reserved_gib"] / r["measured_peak_mem_gib"] for r in rows
                    if r.get("measured_reserved_gib") and r.get("measured_peak_mem_gib"))
    outside = sorted(r["outside_allocator_gib"] for r in rows if r.get("outside_allocator_gib") is not None)
    if ratios:
        out += ["", f"Allocator: reserved / allocated peak {ratios[0]:.3f}-{ratios[-1]:.3f} (the calibration's "
                f"memory.reserved_over_allocated: use {ratios[-1]:.3f}); device memory outside the allocator "
                f"{outside[0]:.2f}-{outside[-1]:.2f} GiB (memory.outside_allocator_bytes: use "
                f"{outside[-1] * 2 ** 30:.3g})."]
    out += ["", "Commands:", ""] + [f"- {r['config']}: `{r['command']}`" for r in rows]
    return "\n".join(out) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--run-one":
        run_one(sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--run", action="store_true", help="run every configuration on this machine's GPU(s)")
    mode.add_argument("--from-records", action="store_true", help="compare with the runs recorded in bench/results")
    ap.add_argument("--calibration", default="h200", help="GPU kind or calibration JSON")
    ap.add_argument("--smoke", action="store_true",
                    help="with --run: one tiny configuration instead of the validation set (checks the machinery)")
    ap.add_argument("--only", default="", help="comma-separated configuration names (--run)")
    shared_vocab = os.path.join(os.path.dirname(ROOT), "shared", "data", "bert", "vocab.txt")
    ap.add_argument("--bert-vocab-file",
                    default=os.environ.get("BERT_VOCAB_FILE", shared_vocab if os.path.exists(shared_vocab) else ""),
                    help="WordPiece vocabulary for the BERT rows (e.g. the shared data's bert vocab)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="output prefix (default bench/results/plan_validation[_records])")
    args = ap.parse_args()
    cal = load_calibration(args.calibration)
    command = "python bench/plan_validation.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.run:
        out = args.out or os.path.join(ROOT, "bench", "results", "plan_validation")
        log_dir = out + "_logs"
        os.makedirs(log_dir, exist_ok=True)
        rows = run_all(cal, set(filter(None, args.only.split(","))), args.iters, args.warmup, log_dir,
                       args.bert_vocab_file, SMOKE if args.smoke else None)
        title = f"Planner against measurement ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)"
    else:
        out = args.out or os.path.join(ROOT, "bench", "results", "plan_validation_records")
        rows = from_records(cal)
        title = "Planner against the runs recorded in bench/results"
    with open(out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(rows, title, cal, command))
    print(markdown(rows, title, cal, command))


if __name__ == "__main__":
    main()
