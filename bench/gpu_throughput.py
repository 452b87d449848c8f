"""Throughput and MFU of our trainer against its peers, on identical shapes and tokens, in one run on one GPU.

Trainers (``--trainers``, comma-separated):
  ours              pretrain_gpt.py as a subprocess; its iteration log lines are parsed and the first ``--warmup``
                    iterations skipped (bf16)
  ours-fp8          the same with ``--fp8-format hybrid``: FP8 GEMMs in the transformer layers' linears, on top of
                    the bf16 model (not the precision of the peers: read its row next to ``ours``)
  hf-gpt2           Hugging Face transformers GPT2LMHeadModel, SDPA attention, bf16 autocast, fused AdamW
  minimal-eager     bench/minimal_gpt.py (SDPA, bf16 autocast, fused AdamW)
  minimal-compiled  the same under torch.compile
Shapes (``--shapes``): ``1.3b`` (24 layers, h 2048, 16 heads, seq 2048, micro-batch 8) and ``124m`` (12 layers,
h 768, 12 heads, seq 1024, micro-batch 16); vocabulary 50,304, bf16, AdamW, dropout 0, clip-grad 1.0. ``tiny``
(2 layers, h 64) checks the script on a machine without a GPU (peers in fp32 on the CPU; no meaningful MFU).

Every trainer trains on the same tokens: the bundled corpus tokenised once into a .bin/.idx pair and read through
the library's GPT dataset and data loader (``bench/corpus.py``), so iteration i of every trainer sees the same
samples. MFU = tokens/s x model FLOPs per token / peak, with the FLOPs of ``megatron.core.model_counts.
flops_per_token`` (Megatron's 72 L h^2 + 12 L h s + 6 h V per token for ffn = 4h, no recomputation
counted) and the dense bf16 peak (``--bf16-peak-tflops``, 989 on H100/H200 SXM); ours-fp8 rows also give MFU
against the dense FP8 peak (``--fp8-peak-tflops``, 1979). Each trainer/shape runs in its own process so peak memory
(torch.cuda.max_memory_allocated) is its own. ``--variant LABEL:FLAGS`` (repeatable) runs our trainers once per
variant with FLAGS added, e.g. the recomputation settings.

Writes ``bench/results/gpu_throughput[_TAG].json`` (rows with the keys trainer, num_layers, hidden_size,
seq_length, micro_batch_size, ms_per_iter, tokens_per_s, mfu, mfu_fp8_peak, peak_mem_gib, command) and a Markdown
table beside it, with the GPU, software versions, date and the exact command. For our trainer the extras also keep
the losses and each averaged iteration's time (``iter_ms``, listed under the table with their median).

    python bench/gpu_throughput.py                                   # everything
    python bench/gpu_throughput.py --trainers hf-gpt2,minimal-eager,minimal-compiled --shapes 124m,1.3b
    python bench/gpu_throughput.py --trainers ours --ours-args "--use-torch-compile" --tag compile
    python bench/gpu_throughput.py --shapes tiny --trainers ours,minimal-eager,hf-gpt2 --iters 2 --warmup 1 \\
        --results-dir /tmp/bench_check                               # a check of the script on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from corpus import batches, prepare_dataset, trainer_context, trainer_flags  # noqa: E402
from megatron.core.model_counts import flops_per_token as spec_flops_per_token  # noqa: E402

BF16_PEAK_TFLOPS = 989.0  # dense bf16 tensor-core peak of an H100/H200 SXM
FP8_PEAK_TFLOPS = 1979.0  # dense FP8 peak of the same GPUs
VOCAB = 50304
SHAPES = {
    "1.3b": dict(num_layers=24, hidden_size=2048, num_heads=16, seq_length=2048, micro_batch_size=8),
    "124m": dict(num_layers=12, hidden_size=768, num_heads=12, seq_length=1024, micro_batch_size=16),
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=128, micro_batch_size=2),  # CPU check
}
TRAINERS = ("hf-gpt2", "minimal-eager", "minimal-compiled", "ours", "ours-fp8")
OURS_FP8_ARGS = "--fp8-format hybrid"  # ours-fp8: our trainer with FP8 GEMMs in the transformer layers
# Flags our trainer gets on top of the shape; --ours-args appends (later flags win in argparse).
OURS_BASE_ARGS = (
    "--bf16 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--eval-iters 0 --log-interval 1 --log-throughput --cross-entropy-loss-fusion"
)


def ours_flags(shape: dict, iters: int, warmup: int, data_prefix, extra: str = "", micro_batch: int = 0,
               global_batch: int = 0) -> list:
    """The ``pretrain_gpt.py`` flags of our trainer at a shape of ``SHAPES`` (``bench/corpus.py``'s shape, batch
    and data flags, then ``OURS_BASE_ARGS`` and ``extra``); micro and global batch default to the shape's
    micro-batch; ``data_prefix=None``: ``--mock-data``."""
    micro = micro_batch or shape["micro_batch_size"]
    return (trainer_flags(data_prefix, shape["num_layers"], shape["hidden_size"], shape["num_heads"],
                          shape["seq_length"], micro, iters + warmup, global_batch or micro)
            + shlex.split(f"{OURS_BASE_ARGS} {extra}"))


@lru_cache(maxsize=None)
def _flops_per_token(num_layers: int, hidden_size: int, num_heads: int, seq_length: int) -> float:
    shape = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, seq_length=seq_length,
                 micro_batch_size=1)
    ctx = trainer_context(ours_flags(shape, 100, 0, None))  # --mock-data: no corpus needed
    return spec_flops_per_token(ctx.config.model.spec(ctx.padded_vocab_size))


def flops_per_token(shape: dict) -> float:
    """Model FLOPs per token of one training iteration: the library's count (the trainer's log line) for the
    model section and padded vocabulary our trainer builds at this shape."""
    return _flops_per_token(shape["num_layers"], shape["hidden_size"], shape["num_heads"], shape["seq_length"])


def mfu(tokens_per_s: float, shape: dict, peak_tflops: float = BF16_PEAK_TFLOPS) -> float:
    """Model FLOPs utilisation against ``peak_tflops`` (the dense bf16 peak unless told otherwise)."""
    return tokens_per_s * flops_per_token(shape) / (peak_tflops * 1e12)


# ---------------------------------------------------------------------------------------------------------------
# peers (run in a child process: ``--worker TRAINER --shape NAME``)
# ---------------------------------------------------------------------------------------------------------------
def _hf_model(shape: dict, vocab: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=shape["seq_length"], n_embd=shape["hidden_size"],
                     n_layer=shape["num_layers"], n_head=shape["num_heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, use_cache=False)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        try:
            model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
        except (TypeError, AttributeError, ValueError):
            cfg._attn_implementation = "sdpa"
            model = GPT2LMHeadModel(cfg)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise RuntimeError(f"transformers picked attention implementation {impl!r}, not sdpa")
    return model


def run_worker(trainer: str, shape_name: str, iters: int, warmup: int, data_prefix: str) -> dict:
    import torch
    import torch.nn.functional as F
    from minimal_gpt import MinimalGPT, train_and_time

    torch.backends.cuda.matmul.allow_tf32 = True
    shape = SHAPES[shape_name]
    flags = ours_flags(shape, iters, warmup, data_prefix)
    data = batches(flags)  # what ours reads, iteration by iteration
    vocab = trainer_context(flags).padded_vocab_size  # the embedding rows of our model
    if trainer == "hf-gpt2":
        model = _hf_model(shape, vocab)

        def step(idx, tgt):  # the loss over the same targets as the other trainers (HF's labels= would shift)
            logits = model(input_ids=idx).logits  # [b, s, V]
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.reshape(-1))
    else:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = MinimalGPT(shape["num_layers"], shape["hidden_size"], shape["num_heads"],
                               shape["seq_length"], vocab)
        step = torch.compile(model) if trainer == "minimal-compiled" else model
    return train_and_time(model, step, data, iters, warmup)


# ---------------------------------------------------------------------------------------------------------------
# ours: dataset + pretrain_gpt.py subprocess + log parsing
# ---------------------------------------------------------------------------------------------------------------
def ours_command(shape: dict, iters: int, warmup: int, data_prefix: str, extra: str, micro_batch: int = 0,
                 global_batch: int = 0) -> list:
    """``python gpu_throughput.py --run-ours -- pretrain_gpt.py FLAGS`` for a shape (micro and global batch
    default to the shape's micro-batch)."""
    return [sys.executable, os.path.join(ROOT, "bench", "gpu_throughput.py"), "--run-ours", "--",
            os.path.join(ROOT, "pretrain_gpt.py")] + ours_flags(shape, iters, warmup, data_prefix, extra, micro_batch,
                                                                global_batch)


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
    (the step executor's ``launch``; the run needs start+count iterations) are recorded with
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
        make_executor = getattr(getattr(training_mod, "Trainer", None), "make_step_executor", None)
        if make_executor is None:
            raise SystemExit("BENCH_PROFILE: megatron.training.training.Trainer.make_step_executor (which builds "
                             "the object whose launch() starts a step) is not there; point the profiling hook at "
                             "the function that starts a step")
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

        def profiled_executor(self):
            executor = make_executor(self)
            launch = executor.launch

            def profiled_launch(ahead):
                # the window holds exactly the steps launched as the start-th .. (start+count-1)-th
                state["n"] += 1
                if state["n"] == start + count and state["prof"] is not None:
                    stop()
                if state["n"] == start:
                    sync()  # nothing launched earlier runs inside the window
                    state["prof"] = torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                    state["prof"].__enter__()
                return launch(ahead)

            executor.launch = profiled_launch  # this executor's steps all start here
            return executor

        training_mod.Trainer.make_step_executor = profiled_executor
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def run_ours(shape_name: str, iters: int, warmup: int, data_prefix: str, extra: str, log_dir: str,
             trainer: str = "ours", shape: dict = None) -> dict:
    """pretrain_gpt.py at ``SHAPES[shape_name]`` (or the dict ``shape`` of another script, logged under
    ``shape_name``) as a subprocess; its log parsed (``parse_ours_log``)."""
    cmd = ours_command(shape or SHAPES[shape_name], iters, warmup, data_prefix, extra)
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


def make_row(trainer: str, shape_name: str, res: dict, command: str, peaks: tuple) -> dict:
    """One table row; ``peaks`` = (bf16, FP8) dense peak TFLOP/s. ``mfu_fp8_peak`` only for FP8 rows."""
    s = SHAPES[shape_name]
    tokens = s["micro_batch_size"] * s["seq_length"] / (res["ms_per_iter"] / 1000)
    L, h, seq = s["num_layers"], s["hidden_size"], s["seq_length"]
    fp8 = trainer.startswith("ours-fp8")
    return {"trainer": trainer, "num_layers": L, "hidden_size": h, "seq_length": seq,
            "micro_batch_size": s["micro_batch_size"], "ms_per_iter": round(res["ms_per_iter"], 2),
            "tokens_per_s": round(tokens, 1), "mfu": round(mfu(tokens, s, peaks[0]), 4),
            "mfu_fp8_peak": round(mfu(tokens, s, peaks[1]), 4) if fp8 else None,
            "peak_mem_gib": None if res.get("peak_mem_gib") is None else round(res["peak_mem_gib"], 2),
            "command": command}


def write_results(path_json: str, meta: dict, rows: list, extras: dict) -> None:
    with open(path_json, "w") as f:
        json.dump({**meta, "rows": rows, "extras": extras}, f, indent=2)
    bf16_peak, fp8_peak = meta["peak_tflops"]["bf16"], meta["peak_tflops"]["fp8"]
    md = [f"# GPU throughput ({meta['date']})", "",
          f"GPU: {meta['env']['gpu']}; torch {meta['env']['torch']} (CUDA {meta['env']['cuda']}), "
          f"triton {meta['env']['triton']}, transformers {meta['env']['transformers']}, "
          f"Python {meta['env']['python']}.", "",
          f"Command: `{meta['command']}`", "",
          "Every trainer reads the same tokens (the bundled corpus as one .bin/.idx through the library's GPT "
          "dataset and loader, bench/corpus.py). MFU = tokens/s x model FLOPs per token "
          "(GPT rows: 72 L h^2 + 12 L h s + 6 h V, V = 50304; megatron.core.model_counts.flops_per_token) / peak: "
          f"bf16 dense peak {bf16_peak:g} TFLOP/s for every row; FP8 rows also against the FP8 dense peak "
          f"{fp8_peak:g} TFLOP/s (FP8 GEMMs in the transformer layers, same bf16 model and FLOP count). "
          "bf16, AdamW, dropout 0.", "",
          f"| trainer | layers | hidden | seq | micro-batch | ms/iter | tokens/s | MFU (bf16 peak {bf16_peak:g}) | "
          f"MFU (FP8 peak {fp8_peak:g}) | log TFLOP/s | peak mem (GiB) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = f"{r['trainer']}/{r['num_layers']}x{r['hidden_size']}"
        tfl = extras.get("log_tflops", {}).get(key)
        tfl_s = "" if tfl is None else f"{tfl:.1f}"
        mem_s = "" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        fp8_s = "" if r.get("mfu_fp8_peak") is None else f"{100 * r['mfu_fp8_peak']:.1f}%"
        md.append(f"| {r['trainer']} | {r['num_layers']} | {r['hidden_size']} | {r['seq_length']} | "
                  f"{r['micro_batch_size']} | {r['ms_per_iter']:.1f} | {r['tokens_per_s']:,.0f} | "
                  f"{100 * r['mfu']:.1f}% | {fp8_s} | {tfl_s} | {mem_s} |")
    bert = extras.get("bert")
    if bert:  # rows of bench/bert_throughput.py: another model, FLOP count and command
        md += ["", f"Rows ours-bert / hf-bert: BERT (masked LM + sentence order, bench/bert_throughput.py, run "
               f"{meta.get('bert_date', '?')}: `{meta.get('bert_command', '?')}`); MFU with "
               f"{bert.get('flops_per_token')} FLOPs per token, V = {bert.get('padded_vocab')}."]
    llama = extras.get("llama")
    if llama:  # rows of bench/llama_throughput.py: Llama-shaped models, their own FLOP count and command
        md += ["", f"Rows ours-llama, ours-llama-fp8, torchtitan, torchtitan-fp8, megatron-core, hf-llama-compiled: "
               f"Llama-shaped models (bench/llama_throughput.py, run {meta.get('llama_date', '?')}: "
               f"`{meta.get('llama_command', '?')}`); {llama.get('note', '')} FLOPs per token (spec count, "
               f"megatron.core.model_counts.flops_per_token): {llama.get('flops_per_token')}; peer versions: "
               f"{llama.get('versions')}."]
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
    errors = extras.get("errors", {})
    if errors:
        md += ["", "Failed rows:", ""] + [f"- {key}: {msg.strip().splitlines()[-1] if msg.strip() else msg}"
                                          for key, msg in errors.items()]
    md += ["", "Per-row commands:", ""] + [f"- {r['trainer']} {r['num_layers']}x{r['hidden_size']}: `{r['command']}`"
                                           for r in rows]
    with open(path_json[:-5] + ".md", "w") as f:
        f.write("\n".join(md) + "\n")


def merge_rows(path_json: str, meta: dict, rows: list, extras: dict, family: str) -> None:
    """Put the ``rows`` of another script (``family``: "bert", "llama") into the table ``path_json``: rows of the
    same trainer and shape are replaced, the others kept; ``extras`` and the script's command and date are kept
    under the family's name."""
    old = {}
    if os.path.exists(path_json):
        with open(path_json) as f:
            old = json.load(f)
    keys = {(r["trainer"], r["num_layers"], r["hidden_size"]) for r in rows}
    kept = [r for r in old.get("rows", []) if (r["trainer"], r["num_layers"], r["hidden_size"]) not in keys]
    merged_extras = old.get("extras", {})
    before = merged_extras.get(family, {})  # per-row and per-shape records of the kept rows stay
    merged_extras[family] = {k: {**before[k], **v} if k != "errors" and isinstance(v, dict)
                             and isinstance(before.get(k), dict) else v for k, v in extras.items()}
    merged_meta = {**meta, **{k: v for k, v in old.items() if k not in ("rows", "extras")}} if old else meta
    merged_meta[f"{family}_command"] = meta["command"]
    merged_meta[f"{family}_date"] = meta["date"]
    write_results(path_json, merged_meta, kept + rows, merged_extras)


def comma_choices(flag: str, value: str, allowed) -> list:
    """The items of a comma-separated flag value, each one of ``allowed`` (else one error line naming it)."""
    items = [v for v in value.split(",") if v]
    for v in items:
        if v not in allowed:
            raise SystemExit(f"{flag}: unknown value {v!r}; choose from {', '.join(allowed)}")
    return items


def _glue_values(argv: list) -> list:
    """``--ours-args --flag`` would make argparse read --flag as an option: glue each value to its option."""
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] in ("--ours-args", "--ours-shape-args", "--ours-fp8-shape-args", "--ours-fp8-args", "--variant"):
            out[i:i + 2] = [f"{out[i]}={out[i + 1]}", ""]
    return [x for x in out if x != ""]


def our_flags(trainer: str, shape_name: str, a) -> str:
    """The flags of one of our rows beyond the shape and OURS_BASE_ARGS, from --ours-args and the shape args."""
    fp8 = trainer == "ours-fp8"
    extra = f"{a.ours_args} {OURS_FP8_ARGS}" if fp8 else a.ours_args
    for spec in (a.ours_fp8_shape_args if fp8 else a.ours_shape_args):
        name, _, flags = spec.partition(":")
        if name not in SHAPES:
            raise ValueError(f"--ours{'-fp8' if fp8 else ''}-shape-args: unknown shape {name!r} in {spec!r}")
        if name == shape_name:
            extra = f"{extra} {flags}"
    return extra.strip()


def run_peer(trainer: str, shape_name: str, a, data_prefix: str) -> tuple:
    """A peer in its own process (``--worker``); returns (result, command)."""
    argv = [sys.executable, os.path.abspath(__file__), "--worker", trainer, "--shape", shape_name,
            "--iters", str(a.iters), "--warmup", str(a.warmup), "--data-prefix", data_prefix]
    proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    cmd = f"python bench/gpu_throughput.py --worker {trainer} --shape {shape_name} --iters {a.iters} --warmup {a.warmup}"
    return json.loads(found[-1][len("BENCH_RESULT "):]), cmd


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run-ours":
        run_ours_wrapper(sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description="Throughput/MFU of our trainer and its peers on one GPU, same tokens.")
    ap.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma list of {', '.join(TRAINERS)}")
    ap.add_argument("--shapes", default="1.3b,124m", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=15, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5, help="untimed warm-up iterations (compilation included)")
    ap.add_argument("--ours-args", default="", help="extra flags for pretrain_gpt.py")
    ap.add_argument("--ours-shape-args", action="append", default=[], metavar="SHAPE:FLAGS",
                    help="extra flags for pretrain_gpt.py at one shape only, e.g. '124m:--use-torch-compile'")
    ap.add_argument("--ours-fp8-shape-args", action="append", default=[], metavar="SHAPE:FLAGS",
                    help=f"the same for ours-fp8 (which adds {OURS_FP8_ARGS!r} to --ours-args)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:FLAGS",
                    help="run each of our trainers once per variant with FLAGS added; rows named TRAINER[LABEL]")
    ap.add_argument("--bf16-peak-tflops", type=float, default=BF16_PEAK_TFLOPS,
                    help="dense bf16 peak of the GPU for MFU (default: H100/H200 SXM)")
    ap.add_argument("--fp8-peak-tflops", type=float, default=FP8_PEAK_TFLOPS,
                    help="dense FP8 peak of the GPU for the FP8 rows' second MFU (default: H100/H200 SXM)")
    ap.add_argument("--data-prefix", default=None, help=".bin/.idx prefix (default: tokenise the bundled corpus)")
    ap.add_argument("--tag", default="", help="write gpu_throughput_TAG.{json,md} instead of the main table")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--log-dir", default=None, help="where to keep our trainer's full logs")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(_glue_values(sys.argv[1:]))
    if a.worker:
        if not a.data_prefix:
            raise SystemExit("--worker needs --data-prefix")
        print("BENCH_RESULT " + json.dumps(run_worker(a.worker, a.shape, a.iters, a.warmup, a.data_prefix)),
              flush=True)
        return
    trainers = comma_choices("--trainers", a.trainers, TRAINERS)
    shapes = comma_choices("--shapes", a.shapes, SHAPES)
    variants = [tuple(v.partition(":")[::2]) for v in a.variant]
    if any(not label for label, _ in variants):
        raise SystemExit("--variant: expected LABEL:FLAGS with a non-empty LABEL")
    variants = variants or [("", "")]
    if a.data_prefix and not (os.path.exists(a.data_prefix + ".bin") and os.path.exists(a.data_prefix + ".idx")):
        raise SystemExit(f"--data-prefix {a.data_prefix}: expected {a.data_prefix}.bin and {a.data_prefix}.idx")
    os.makedirs(a.results_dir, exist_ok=True)
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    command = "python bench/gpu_throughput.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "env": environment(), "command": command,
            "peak_tflops": {"bf16": a.bf16_peak_tflops, "fp8": a.fp8_peak_tflops}}
    peaks = (a.bf16_peak_tflops, a.fp8_peak_tflops)
    out_json = os.path.join(a.results_dir, f"gpu_throughput{'_' + a.tag if a.tag else ''}.json")
    rows, extras = [], {"log_tflops": {}, "losses": {}, "iter_ms": {}, "replay_ms": {}, "errors": {}}
    data_prefix = a.data_prefix or prepare_dataset(tempfile.mkdtemp(prefix="bench_data_"))
    for shape_name in shapes:
        for trainer in trainers:
            ours = trainer in ("ours", "ours-fp8")
            for label, vflags in (variants if ours else [("", "")]):
                name = f"{trainer}[{label}]" if label else trainer
                key = f"{name}/{SHAPES[shape_name]['num_layers']}x{SHAPES[shape_name]['hidden_size']}"
                t0 = time.time()
                try:
                    if ours:
                        extra = f"{our_flags(trainer, shape_name, a)} {vflags}".strip()
                        res = run_ours(shape_name, a.iters, a.warmup, data_prefix, extra, a.log_dir,
                                       name.replace("[", "_").replace("]", ""))
                        cmd = res["command"]
                        for k in ("log_tflops", "losses", "iter_ms"):
                            extras[k][key] = res[k]
                        if res["replay_ms"]:
                            extras["replay_ms"][key] = res["replay_ms"]
                    else:
                        res, cmd = run_peer(trainer, shape_name, a, data_prefix)
                        extras["losses"][key] = res.get("losses")
                except Exception as exc:  # keep measuring the others; the failure is recorded
                    print(f"!! {key} failed: {exc}", flush=True)
                    extras["errors"][key] = str(exc)[-2000:]
                    continue
                row = make_row(name, shape_name, res, cmd, peaks)
                rows.append(row)
                fp8_s = "" if row["mfu_fp8_peak"] is None else f" ({100 * row['mfu_fp8_peak']:.1f}% of the FP8 peak)"
                print(f"{key}: {row['ms_per_iter']:.1f} ms/iter, {row['tokens_per_s']:,.0f} tok/s, "
                      f"MFU {100 * row['mfu']:.1f}% of the bf16 peak{fp8_s}, peak {row['peak_mem_gib']} GiB "
                      f"({time.time() - t0:.0f} s)", flush=True)
                write_results(out_json, meta, rows, extras)
    write_results(out_json, meta, rows, extras)
    print(open(out_json[:-5] + ".md").read(), flush=True)
    if extras["errors"]:
        raise SystemExit(f"failed rows: {', '.join(extras['errors'])}")


if __name__ == "__main__":
    main()
