"""Host time per transformer layer of an eager training step: a CPU proxy that runs anywhere.

At tiny shapes a step's arithmetic is negligible, so the time of an iteration is what the host spends issuing
it: Python, the dispatcher, autograd, hooks, the optimizer. For each model (GPT through ``pretrain_gpt.py``, BERT
through ``pretrain_bert.py``, ``--mock-data``, one process, eager, fp32) the trainer runs with ``--num-layers`` L
for several L; the median ``elapsed time per iteration (ms)`` of its own log line after ``--warmup`` iterations is
fitted by least squares against L. The slope is the host time per layer; the intercept is the per-step cost
outside the layers (embedding, loss, optimizer step, logging).

The same runs also count the ATen operators one layer issues in forward + backward (a ``TorchDispatchMode`` over a
``TransformerBlock`` of 1 and of 2 layers; the difference is one layer): a machine-independent measure of the same
overhead, which changes only when the code does.

    python bench/host_overhead.py                       # writes bench/results/host_overhead.{json,md}
    python bench/host_overhead.py --iters 12 --layers 1 2 --results-dir /tmp/x   # a quick check

On a GPU machine add ``--device cuda`` to time the same steps there (every kernel is tiny, so the step is
host-bound and the slope is the eager host cost per layer that a large model pays too).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results_io import run_meta, write_results  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.parallel_state import ParallelState  # noqa: E402
from megatron.core.transformer.block import TransformerBlock  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402

ITER_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([0-9.]+)")

# tiny shapes: every GEMM is a few microseconds, so the iteration time is host time
SHAPE = dict(hidden=32, heads=4, seq=32, batch=2)


def _write_vocab(folder: str) -> str:
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(250)]
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(words) + "\n")
    return path


def trainer_argv(model: str, layers: int, iters: int, device: str, tmp: str) -> list:
    s = SHAPE
    argv = ["--num-layers", str(layers), "--hidden-size", str(s["hidden"]), "--num-attention-heads", str(s["heads"]),
            "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]),
            "--micro-batch-size", str(s["batch"]), "--global-batch-size", str(s["batch"]),
            "--train-iters", str(iters), "--lr", "1e-4", "--mock-data", "--log-interval", "1",
            "--num-workers", "0", "--eval-iters", "0", "--seed", "1234"]
    if model == "gpt":
        argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
    else:
        argv += ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", _write_vocab(tmp)]
    if device == "cpu":
        argv += ["--distributed-backend", "gloo"]
    return argv


def time_iterations(model: str, layers: int, iters: int, warmup: int, device: str) -> float:
    """Median ms per iteration after ``warmup`` iterations, read from the trainer's own log line."""
    script = os.path.join(ROOT, "pretrain_gpt.py" if model == "gpt" else "pretrain_bert.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, script, *trainer_argv(model, layers, iters, device, tmp)],
                             env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{model} with {layers} layers failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    times = [float(ms) for it, ms in ITER_MS.findall(out.stdout) if int(it) > warmup]
    if not times:
        raise SystemExit(f"{model} with {layers} layers printed no iteration lines after {warmup}")
    return statistics.median(times)


def fit_line(xs, ys):
    """Least-squares (slope, intercept)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def ops_per_layer(model: str) -> dict:
    """ATen operators of one layer's forward + backward (a 2-layer block minus a 1-layer block)."""
    s = SHAPE
    counts = {}
    for layers in (1, 2):
        cfg = TransformerConfig(num_layers=layers, hidden_size=s["hidden"], num_attention_heads=s["heads"],
                                seq_length=s["seq"], hidden_dropout=0.1, attention_dropout=0.1,
                                attention_mask_type="causal" if model == "gpt" else "padding")
        torch.manual_seed(0)
        tensor_parallel.model_parallel_seed(1234, ParallelState())
        block = TransformerBlock(cfg, ParallelState(), num_layers=layers, post_layer_norm=False)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        dev = next(block.parameters()).device  # the current CUDA device when there is one
        x = torch.randn(s["seq"], s["batch"], s["hidden"], device=dev, requires_grad=True)
        mask = None if model == "gpt" else torch.zeros(s["batch"], 1, 1, s["seq"], dtype=torch.bool, device=dev)
        block(x, mask).sum().backward()  # warm the lazy paths
        with OpCounter() as counter:
            block(x, mask).sum().backward()
        counts[layers] = counter.ops
    one = counts[2] - counts[1]
    return {"total": sum(one.values()), "top": dict(one.most_common(8))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--models", nargs="+", default=["gpt", "bert"], choices=["gpt", "bert"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args(argv)
    if len(set(args.layers)) < 2:
        ap.error("--layers needs at least two different layer counts to fit a slope")
    if args.iters <= args.warmup:
        ap.error("--iters must exceed --warmup")
    rows = []
    for model in args.models:
        ms = [time_iterations(model, n, args.iters, args.warmup, args.device) for n in args.layers]
        slope, intercept = fit_line(args.layers, ms)
        ops = ops_per_layer(model)
        rows.append({"model": model, "device": args.device, "layers": args.layers, "ms_per_iteration": ms,
                     "host_ms_per_layer": round(slope, 3), "ms_outside_layers": round(intercept, 3),
                     "aten_ops_per_layer": ops["total"], "top_ops": ops["top"]})
        print(f"{model}: {slope:.3f} ms per layer, {intercept:.3f} ms outside the layers, "
              f"{ops['total']} ATen ops per layer (forward + backward)", flush=True)
    meta = run_meta("host_overhead.py")
    meta["cpu_threads"] = 1
    body = ["Eager training step at tiny shapes (hidden %(hidden)d, %(heads)d heads, seq %(seq)d, micro-batch "
            "%(batch)d, fp32, dropout 0.1, one process): median iteration time of the trainer's log line against "
            "the number of layers, fitted by least squares." % SHAPE, "",
            "| model | device | layers | ms per iteration | host ms per layer | ms outside the layers | ATen ops per layer |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        body.append(f"| {r['model']} | {r['device']} | {', '.join(map(str, r['layers']))} | "
                    f"{', '.join(f'{m:.2f}' for m in r['ms_per_iteration'])} | {r['host_ms_per_layer']:.3f} | "
                    f"{r['ms_outside_layers']:.3f} | {r['aten_ops_per_layer']} |")
    write_results(args.results_dir, "host_overhead_cuda" if args.device == "cuda" else "host_overhead", meta, rows, "Host time per transformer layer", body)


if __name__ == "__main__":
    main()
