"""Throughput and MFU of our trainer against its peers, on identical shapes, in one GPU session.

Trainers (``--trainers``, comma-separated):
  ours              pretrain_gpt.py as a subprocess on a real .bin/.idx dataset; its iteration log lines are parsed
                    and the first ``--warmup`` iterations skipped (bf16)
  ours-fp8          the same with ``--fp8-format hybrid``: FP8 GEMMs in the transformer layers' linears, on top of
                    the bf16 model (not the precision of the peers: read its row next to ``ours``)
  hf-gpt2           Hugging Face transformers GPT2LMHeadModel, SDPA attention, bf16 autocast, fused AdamW
  minimal-eager     bench/minimal_gpt.py (SDPA, bf16 autocast, fused AdamW)
  minimal-compiled  the same under torch.compile
Shapes (``--shapes``): ``1.3b`` (24 layers, h 2048, 16 heads, seq 2048, micro-batch 8) and ``124m`` (12 layers,
h 768, 12 heads, seq 1024, micro-batch 16); vocabulary 50,304, bf16, AdamW, dropout 0, clip-grad 1.0.

MFU = tokens/s x (72 L h^2 + 12 L h s + 6 h V) / 989e12 (Megatron's model FLOPs per token, no recompute).
Each trainer/shape runs in its own process so peak memory (torch.cuda.max_memory_allocated) is its own.
Writes ``bench/results/gpu_throughput[_TAG].json`` (rows with the keys trainer, num_layers, hidden_size,
seq_length, micro_batch_size, ms_per_iter, tokens_per_s, mfu, peak_mem_gib, command) and a Markdown table
beside it, with the GPU, software versions, date and the exact command. For our trainer the extras also keep the
losses and each averaged iteration's time (``iter_ms``, listed under the table with their median).

    python bench/gpu_throughput.py                                   # everything
    python bench/gpu_throughput.py --trainers hf-gpt2,minimal-eager,minimal-compiled --shapes 124m,1.3b
    python bench/gpu_throughput.py --trainers ours --ours-args "--use-torch-compile" --tag compile
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

PEAK_FLOPS = 989e12
VOCAB = 50304
SHAPES = {
    "1.3b": dict(num_layers=24, hidden_size=2048, num_heads=16, seq_length=2048, micro_batch_size=8),
    "124m": dict(num_layers=12, hidden_size=768, num_heads=12, seq_length=1024, micro_batch_size=16),
}
TRAINERS = ("hf-gpt2", "minimal-eager", "minimal-compiled", "ours", "ours-fp8")
OURS_FP8_ARGS = "--fp8-format hybrid"  # ours-fp8: our trainer with FP8 GEMMs in the transformer layers
# Flags our trainer gets on top of the shape; --ours-args appends (later flags win in argparse).
OURS_BASE_ARGS = (
    "--bf16 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--tokenizer-type GPT2BPETokenizer --make-vocab-size-divisible-by 128 --split 100,0,0 --eval-iters 0 "
    "--log-interval 1 --log-throughput --seed 1234 --num-workers 2 --cross-entropy-loss-fusion"
)


def flops_per_token(L: int, h: int, s: int, V: int = VOCAB) -> float:
    return 72 * L * h * h + 12 * L * h * s + 6 * h * V


def mfu(tokens_per_s: float, L: int, h: int, s: int) -> float:
    return tokens_per_s * flops_per_token(L, h, s) / PEAK_FLOPS


# ---------------------------------------------------------------------------------------------------------------
# peers (run in a child process: ``--worker TRAINER --shape NAME``)
# ---------------------------------------------------------------------------------------------------------------
def _hf_model(shape: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=shape["seq_length"], n_embd=shape["hidden_size"],
                     n_layer=shape["num_layers"], n_head=shape["num_heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, use_cache=False)
    with torch.device("cuda"):
        try:
            model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
        except (TypeError, AttributeError, ValueError):
            cfg._attn_implementation = "sdpa"
            model = GPT2LMHeadModel(cfg)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise RuntimeError(f"transformers picked attention implementation {impl!r}, not sdpa")
    return model


def run_worker(trainer: str, shape_name: str, iters: int, warmup: int) -> dict:
    import torch
    from minimal_gpt import MinimalGPT, train_and_time

    torch.backends.cuda.matmul.allow_tf32 = True
    shape = SHAPES[shape_name]
    if trainer == "hf-gpt2":
        model = _hf_model(shape)
        step = lambda idx, tgt: model(input_ids=idx, labels=idx).loss  # noqa: E731 (HF shifts labels itself)
    else:
        with torch.device("cuda"):
            model = MinimalGPT(shape["num_layers"], shape["hidden_size"], shape["num_heads"],
                               shape["seq_length"], VOCAB)
        step = torch.compile(model) if trainer == "minimal-compiled" else model
    res = train_and_time(model, step, VOCAB, shape["seq_length"], shape["micro_batch_size"], iters, warmup)
    return res


# ---------------------------------------------------------------------------------------------------------------
# ours: dataset + pretrain_gpt.py subprocess + log parsing
# ---------------------------------------------------------------------------------------------------------------
def prepare_dataset(workdir: str) -> str:
    """Tokenise the bundled corpus with tools/preprocess_data.py; return the .bin/.idx prefix."""
    prefix = os.path.join(workdir, "bench_text_document")
    if os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx"):
        return prefix
    src = os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz")
    jsonl = os.path.join(workdir, "corpus.jsonl")
    with gzip.open(src, "rb") as fin, open(jsonl, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    out_prefix = os.path.join(workdir, "bench")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
           "--output-prefix", out_prefix, "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", os.path.join(ROOT, "data", "gpt2-vocab.json"),
           "--merge-file", os.path.join(ROOT, "data", "gpt2-merges.txt"), "--append-eod", "--workers", "4"]
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    if not os.path.exists(prefix + ".bin"):
        raise RuntimeError(f"preprocess_data.py did not write {prefix}.bin")
    return prefix


def ours_command(shape: dict, iters: int, warmup: int, data_prefix: str, extra: str, micro_batch: int = 0,
                 global_batch: int = 0) -> list:
    """``python gpu_throughput.py --run-ours -- pretrain_gpt.py FLAGS`` for a shape (micro and global batch
    default to the shape's micro-batch)."""
    s = shape
    micro = micro_batch or s["micro_batch_size"]
    args = (f"--num-layers {s['num_layers']} --hidden-size {s['hidden_size']} --num-attention-heads {s['num_heads']} "
            f"--seq-length {s['seq_length']} --max-position-embeddings {s['seq_length']} "
            f"--micro-batch-size {micro} --global-batch-size {global_batch or micro} "
            f"--train-iters {iters + warmup} --data-path {data_prefix} "
            f"--vocab-file {os.path.join(ROOT, 'data', 'gpt2-vocab.json')} "
            f"--merge-file {os.path.join(ROOT, 'data', 'gpt2-merges.txt')} {OURS_BASE_ARGS} {extra}")
    return [sys.executable, os.path.join(ROOT, "bench", "gpu_throughput.py"), "--run-ours", "--",
            os.path.join(ROOT, "pretrain_gpt.py")] + shlex.split(args)


ITER_RE = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+).*?elapsed time per iteration \(ms\):\s*([0-9.]+)"
                     r"(?:.*?throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.]+))?")
LOSS_RE = re.compile(r"lm loss:\s*([0-9.Ee+-]+)")


def parse_ours_log(text: str, warmup: int) -> dict:
    iters = []
    for line in text.splitlines():
        m = ITER_RE.search(line)
        if m:
            loss = LOSS_RE.search(line)
            iters.append((int(m.group(1)), float(m.group(3)), float(m.group(4)) if m.group(4) else None,
                          float(loss.group(1)) if loss else None))
    timed = [it for it in iters if it[0] > warmup]
    if not timed:
        raise RuntimeError(f"no iteration log lines after warm-up {warmup} (found {len(iters)})")
    ms = sum(t[1] for t in timed) / len(timed)
    tfl = [t[2] for t in timed if t[2] is not None]
    peak = re.findall(r"BENCH_PEAK_MEM_BYTES\s+(\d+)", text)
    replay = re.findall(r"BENCH_GRAPH_REPLAY_MS ([0-9. ]+)", text)
    # one replay per iteration after the eager warm-up steps: the last len(timed) are the averaged iterations
    replay_ms = [float(x) for x in replay[-1].split()][-len(timed):] if replay else []
    return {"ms_per_iter": ms, "log_tflops": sum(tfl) / len(tfl) if tfl else None,
            "peak_mem_gib": int(peak[-1]) / 2**30 if peak else None,
            "losses": [t[3] for t in iters], "iter_ms": [t[1] for t in timed], "replay_ms": replay_ms}


def gpu_timeline_summary(trace_path: str, iterations: int) -> str:
    """Busy and idle GPU time in a Chrome trace: kernels, memsets and copies merged into busy intervals.

    Splits the idle time into gaps shorter than 20 us (between kernels that follow each other, e.g. inside a CUDA
    graph) and longer ones (the GPU waiting for the host), per recorded iteration.
    """
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    if not spans:
        return "BENCH_TIMELINE no GPU activity in the trace"
    busy, short_gaps, long_gaps, n_long = 0.0, 0.0, 0.0, 0
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gap = s - end
            if gap < 20.0:
                short_gaps += gap
            else:
                long_gaps, n_long = long_gaps + gap, n_long + 1
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    n = max(1, iterations)
    return (f"BENCH_TIMELINE per iteration: {len(spans) / n:.0f} GPU activities, busy {busy / n / 1e3:.3f} ms, "
            f"gaps < 20 us {short_gaps / n / 1e3:.3f} ms, longer gaps {long_gaps / n / 1e3:.3f} ms "
            f"({n_long / n:.1f}), span {(spans[-1][1] - spans[0][0]) / n / 1e3:.3f} ms")


def run_ours_wrapper(argv: list) -> None:
    """Run pretrain_gpt.py in this process and print its peak allocated memory at exit.

    With BENCH_PROFILE=start:count, the steps launched as the start-th to (start+count-1)-th
    (``Trainer.launch_step``; the run needs start+count iterations) are recorded with
    torch.profiler and a kernel table plus a Chrome trace are written to BENCH_PROFILE_DIR, and the GPU timeline's
    busy time and gaps per iteration are printed (``BENCH_TIMELINE``).
    """
    import atexit
    import runpy

    import torch

    replays = []  # (start, end) CUDA events around each CUDA-graph replay (--enable-cuda-graph)

    def _report():
        if torch.cuda.is_available():
            print(f"BENCH_PEAK_MEM_BYTES {torch.cuda.max_memory_allocated()}", flush=True)
        if replays:  # the GPU time of each replay, to set against the logged iteration time
            torch.cuda.synchronize()
            ms = [start.elapsed_time(end) for start, end in replays]
            print("BENCH_GRAPH_REPLAY_MS " + " ".join(f"{t:.3f}" for t in ms), flush=True)

    atexit.register(_report)
    if torch.cuda.is_available():
        replay = torch.cuda.CUDAGraph.replay

        def timed_replay(graph):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay(graph)
            end.record()
            replays.append((start, end))

        torch.cuda.CUDAGraph.replay = timed_replay
    prof_spec = os.environ.get("BENCH_PROFILE")
    if prof_spec:
        from megatron.training import training as training_mod

        start, count = (int(x) for x in prof_spec.split(":"))
        out_dir = os.environ.get("BENCH_PROFILE_DIR", ".")
        original = training_mod.Trainer.launch_step
        state = {"n": 0, "prof": None}

        def sync():
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def stop():
            sync()  # every step launched in the window has run (a CUDA-graph step may have been launched ahead)
            prof = state["prof"]
            prof.__exit__(None, None, None)
            state["prof"] = None
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=70,
                                              max_name_column_width=100)
            layers = argv[argv.index("--num-layers") + 1] if "--num-layers" in argv else "x"
            with open(os.path.join(out_dir, f"profile_ours_L{layers}.txt"), "w") as f:
                f.write(table)
            print(table, flush=True)
            trace = os.path.join(out_dir, f"trace_ours_L{layers}.json")
            prof.export_chrome_trace(trace)
            print(gpu_timeline_summary(trace, count), flush=True)

        def launch_step(self, ahead=False):
            # the window holds exactly the steps launched as the start-th .. (start+count-1)-th
            state["n"] += 1
            if state["n"] == start + count and state["prof"] is not None:
                stop()
            if state["n"] == start:
                sync()  # nothing launched earlier runs inside the window
                state["prof"] = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                state["prof"].__enter__()
            return original(self, ahead)

        training_mod.Trainer.launch_step = launch_step
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def run_ours(shape_name: str, iters: int, warmup: int, data_prefix: str, extra: str, log_dir: str,
             trainer: str = "ours") -> dict:
    cmd = ours_command(SHAPES[shape_name], iters, warmup, data_prefix, extra)
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.stdout
    if log_dir:
        with open(os.path.join(log_dir, f"{trainer}_{shape_name}.log"), "w") as f:
            f.write(log)
    if proc.returncode != 0:
        print(log[-6000:], flush=True)
        raise RuntimeError(f"pretrain_gpt.py exited with {proc.returncode}")
    res = parse_ours_log(log, warmup)
    res["wall_s"] = time.time() - t0
    res["command"] = "python pretrain_gpt.py " + " ".join(shlex.quote(c) for c in cmd[5:])
    return res


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------
def environment() -> dict:
    import torch

    env = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = "not installed"
    return env


def make_row(trainer: str, shape_name: str, res: dict, command: str) -> dict:
    s = SHAPES[shape_name]
    tokens = s["micro_batch_size"] * s["seq_length"] / (res["ms_per_iter"] / 1000)
    return {"trainer": trainer, "num_layers": s["num_layers"], "hidden_size": s["hidden_size"],
            "seq_length": s["seq_length"], "micro_batch_size": s["micro_batch_size"],
            "ms_per_iter": round(res["ms_per_iter"], 2), "tokens_per_s": round(tokens, 1),
            "mfu": round(mfu(tokens, s["num_layers"], s["hidden_size"], s["seq_length"]), 4),
            "peak_mem_gib": None if res.get("peak_mem_gib") is None else round(res["peak_mem_gib"], 2),
            "command": command}


def write_results(path_json: str, meta: dict, rows: list, extras: dict) -> None:
    with open(path_json, "w") as f:
        json.dump({**meta, "rows": rows, "extras": extras}, f, indent=2)
    md = [f"# GPU throughput ({meta['date']})", "",
          f"GPU: {meta['env']['gpu']}; torch {meta['env']['torch']} (CUDA {meta['env']['cuda']}), "
          f"triton {meta['env']['triton']}, transformers {meta['env']['transformers']}, "
          f"Python {meta['env']['python']}.", "",
          f"Command: `{meta['command']}`", "",
          "MFU = tokens/s x (72 L h^2 + 12 L h s + 6 h V) / 989e12, V = 50304; bf16, AdamW, dropout 0 (ours-fp8: FP8 GEMMs in the transformer layers, same bf16 model and FLOP count).", "",
          "| trainer | layers | hidden | seq | micro-batch | ms/iter | tokens/s | MFU | log TFLOP/s | peak mem (GiB) |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = f"{r['trainer']}/{r['num_layers']}x{r['hidden_size']}"
        tfl = extras.get("log_tflops", {}).get(key)
        tfl_s = "" if tfl is None else f"{tfl:.1f}"
        mem_s = "" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        md.append(f"| {r['trainer']} | {r['num_layers']} | {r['hidden_size']} | {r['seq_length']} | "
                  f"{r['micro_batch_size']} | {r['ms_per_iter']:.1f} | {r['tokens_per_s']:,.0f} | "
                  f"{100 * r['mfu']:.1f}% | {tfl_s} | {mem_s} |")
    iter_ms = extras.get("iter_ms", {})
    if iter_ms:  # the spread behind each average of our trainer (its log has one time per iteration)
        md += ["", "Our trainer's averaged iterations, one by one (ms), and their median:", ""]
        md += [f"- {key}: {' '.join(f'{t:.1f}' for t in times)} (median {statistics.median(times):.1f})"
               for key, times in iter_ms.items() if times]
    replay_ms = extras.get("replay_ms", {})
    if replay_ms:  # under --enable-cuda-graph: what of the iteration the GPU spends in the graph
        md += ["", "GPU time of each CUDA-graph replay (ms, CUDA events around `replay()`), its median, and the "
               "median iteration's time outside it:", ""]
        for key, times in replay_ms.items():
            rest = statistics.median(iter_ms.get(key) or [float("nan")]) - statistics.median(times)
            md.append(f"- {key}: {' '.join(f'{t:.2f}' for t in times)} (median {statistics.median(times):.2f}; "
                      f"outside the graph {rest:.2f})")
    md += ["", "Per-row commands:", ""] + [f"- {r['trainer']} {r['num_layers']}x{r['hidden_size']}: `{r['command']}`"
                                           for r in rows]
    with open(path_json[:-5] + ".md", "w") as f:
        f.write("\n".join(md) + "\n")


def assemble(paths: list, results_dir: str) -> None:
    """Merge the rows of several result files into gpu_throughput.{json,md}; later files win per trainer/shape.

    Each row keeps its own exact command; the sources (file, date, command) are listed in the output.
    """
    rows, extras, sources = {}, {"log_tflops": {}, "losses": {}, "iter_ms": {}, "replay_ms": {}, "errors": {},
                                 "row_sources": {}}, []
    env = None
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        env = env or d["env"]
        sources.append({"file": os.path.basename(path), "date": d["date"], "command": d["command"]})
        for r in d["rows"]:
            key = f"{r['trainer']}/{r['num_layers']}x{r['hidden_size']}"
            rows[key] = r
            extras["row_sources"][key] = f"{os.path.basename(path)} ({d['date']})"
            for k in ("log_tflops", "losses", "iter_ms", "replay_ms"):
                if key in d.get("extras", {}).get(k, {}):
                    extras[k][key] = d["extras"][k][key]
    order = {t: i for i, t in enumerate(TRAINERS)}
    ordered = sorted(rows.values(), key=lambda r: (-r["num_layers"], order[r["trainer"]]))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "env": env,
            "command": "python bench/gpu_throughput.py --assemble " + " ".join(os.path.basename(p) for p in paths),
            "sources": sources}
    out = os.path.join(results_dir, "gpu_throughput.json")
    write_results(out, meta, ordered, extras)
    with open(out[:-5] + ".md", "a") as f:
        f.write("\nRows assembled from these runs (same H200 lease series, one session):\n\n")
        for key, src in extras["row_sources"].items():
            f.write(f"- {key}: {src}\n")
        for src in sources:
            f.write(f"- {src['file']}: `{src['command']}`\n")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--assemble":
        assemble(sys.argv[2:], os.path.join(ROOT, "bench", "results"))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--run-ours":
        run_ours_wrapper(sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:])
        return
    # "--ours-args --flag" would make argparse read --flag as an option: glue the value to its option.
    argv = sys.argv[1:]
    for i in range(len(argv) - 1):
        if argv[i] in ("--ours-args", "--ours-shape-args", "--ours-fp8-shape-args"):
            argv[i:i + 2] = [f"{argv[i]}={argv[i + 1]}", ""]
    sys.argv[1:] = [x for x in argv if x != ""]
    from gpu_probes import PROBE_VARIANTS, run_kernel_bench, run_model_probe

    ap = argparse.ArgumentParser(description="Throughput/MFU of our trainer and its peers on one GPU.")
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--shapes", default="1.3b,124m")
    ap.add_argument("--iters", type=int, default=15, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5, help="untimed warm-up iterations (compilation included)")
    ap.add_argument("--ours-args", default="", help="extra flags for pretrain_gpt.py")
    ap.add_argument("--ours-shape-args", action="append", default=[], metavar="SHAPE:FLAGS",
                    help="extra flags for pretrain_gpt.py at one shape only, e.g. '124m:--use-torch-compile'")
    ap.add_argument("--ours-fp8-shape-args", action="append", default=[], metavar="SHAPE:FLAGS",
                    help=f"the same for ours-fp8 (which adds {OURS_FP8_ARGS!r} to --ours-args)")
    ap.add_argument("--data-prefix", default=None, help=".bin/.idx prefix (default: preprocess data/ corpus)")
    ap.add_argument("--tag", default="", help="write gpu_throughput_TAG.{json,md} instead of the main table")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--log-dir", default=None, help="where to keep our trainer's full logs")
    ap.add_argument("--kernels", action="store_true", help="also time the fused kernels (gpu_kernels.{json,md})")
    ap.add_argument("--kernels-compiled", action="store_true", help="with --kernels: also torch.compile'd references")
    ap.add_argument("--probe", default="", help="comma list of SHAPE:VARIANT[:profile] model probes "
                    f"(variants: {', '.join(PROBE_VARIANTS)}); results in model_probe.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "probe":
        shape_name, variant, *prof = a.shape.split(":")
        path = os.path.join(a.results_dir, f"profile_{shape_name}_{variant}.txt") if prof else ""
        print("BENCH_RESULT " + json.dumps(run_model_probe(shape_name, variant, a.iters, a.warmup, path)), flush=True)
        return
    if a.worker:
        print("BENCH_RESULT " + json.dumps(run_worker(a.worker, a.shape, a.iters, a.warmup)), flush=True)
        return
    os.makedirs(a.results_dir, exist_ok=True)
    trainers = [t for t in a.trainers.split(",") if t]
    shapes = [s for s in a.shapes.split(",") if s]
    for t in trainers:
        if t not in TRAINERS:
            raise ValueError(f"--trainers: unknown trainer {t!r}; choose from {', '.join(TRAINERS)}")
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"--shapes: unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    command = "python bench/gpu_throughput.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "env": environment(), "command": command}
    os.makedirs(a.results_dir, exist_ok=True)
    out_json = os.path.join(a.results_dir, f"gpu_throughput{'_' + a.tag if a.tag else ''}.json")
    rows, extras = [], {"log_tflops": {}, "losses": {}, "iter_ms": {}, "replay_ms": {}, "errors": {}}
    data_prefix = a.data_prefix
    workdir = tempfile.mkdtemp(prefix="bench_data_")
    for shape_name in shapes:
        for trainer in trainers:
            key = f"{trainer}/{SHAPES[shape_name]['num_layers']}x{SHAPES[shape_name]['hidden_size']}"
            t0 = time.time()
            try:
                if trainer in ("ours", "ours-fp8"):
                    data_prefix = data_prefix or prepare_dataset(workdir)
                    fp8 = trainer == "ours-fp8"
                    extra = f"{a.ours_args} {OURS_FP8_ARGS}" if fp8 else a.ours_args
                    for spec in (a.ours_fp8_shape_args if fp8 else a.ours_shape_args):
                        name, _, flags = spec.partition(":")
                        if name not in SHAPES:
                            raise ValueError(f"--ours{'-fp8' if fp8 else ''}-shape-args: unknown shape {name!r} "
                                             f"in {spec!r}")
                        if name == shape_name:
                            extra = f"{extra} {flags}"
                    res = run_ours(shape_name, a.iters, a.warmup, data_prefix, extra.strip(), a.log_dir, trainer)
                    cmd = res["command"]
                    extras["log_tflops"][key] = res["log_tflops"]
                    extras["losses"][key] = res["losses"]
                    extras["iter_ms"][key] = res["iter_ms"]
                    if res["replay_ms"]:
                        extras["replay_ms"][key] = res["replay_ms"]
                else:
                    argv = [sys.executable, os.path.abspath(__file__), "--worker", trainer, "--shape", shape_name,
                            "--iters", str(a.iters), "--warmup", str(a.warmup)]
                    proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True)
                    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
                    if proc.returncode != 0 or not found:
                        raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
                    res = json.loads(found[-1][len("BENCH_RESULT "):])
                    cmd = (f"python bench/gpu_throughput.py --worker {trainer} --shape {shape_name} "
                           f"--iters {a.iters} --warmup {a.warmup}")
            except Exception as exc:  # keep measuring the others; the failure is recorded
                print(f"!! {key} failed: {exc}", flush=True)
                extras["errors"][key] = str(exc)[-2000:]
                continue
            row = make_row(trainer, shape_name, res, cmd)
            rows.append(row)
            print(f"{key}: {row['ms_per_iter']:.1f} ms/iter, {row['tokens_per_s']:,.0f} tok/s, "
                  f"MFU {100 * row['mfu']:.1f}%, peak {row['peak_mem_gib']} GiB ({time.time() - t0:.0f} s)",
                  flush=True)
            write_results(out_json, meta, rows, extras)
    if rows or extras["errors"]:
        write_results(out_json, meta, rows, extras)
        print(open(out_json[:-5] + ".md").read(), flush=True)
    if a.probe:
        probes = []
        for spec in a.probe.split(","):
            argv = [sys.executable, os.path.abspath(__file__), "--worker", "probe", "--shape", spec, "--iters",
                    str(a.iters), "--warmup", str(a.warmup), "--results-dir", a.results_dir]
            env = dict(os.environ)
            if "compiled" in spec:
                env.setdefault("TORCH_LOGS", "recompiles,graph_breaks")
            proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env)
            with open(os.path.join(a.results_dir, "probe_" + spec.replace(":", "_") + ".log"), "w") as f:
                f.write(proc.stdout)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
            probes.append(json.loads(found[-1][13:]) if found else {"spec": spec, "error": proc.stdout[-3000:]})
            print("probe", probes[-1], flush=True)
            with open(os.path.join(a.results_dir, "model_probe.json"), "w") as f:
                json.dump(probes, f, indent=2)

    if a.kernels:
        run_kernel_bench(a.results_dir, a.kernels_compiled)


if __name__ == "__main__":
    main()
