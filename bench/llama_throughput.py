"""Throughput, MFU and peak memory of Llama-shaped models: our trainer against torchtitan, Megatron-Core and Hugging
Face, on the same tokens, in one run on one GPU. Rows merge into ``bench/results/gpu_throughput.{json,md}``.

Shapes (``--shapes``): ``llama-1b`` (Llama-3.2-1B: 16 layers, hidden 2048, 32 heads in 8 key/value groups, SwiGLU
FFN 8192), ``llama-3b`` (Llama-3.2-3B: 28 layers, hidden 3072, 24 heads, 8 groups, FFN 8192), both seq 2048,
micro-batch 4, RMSNorm, RoPE theta 500,000 (no frequency scaling: it changes no FLOP), no biases, untied output
layer, vocabulary 128,256; ``tiny`` (2 layers, hidden 64) checks the script on a machine without a GPU.

Trainers (``--trainers``):
  ours-llama          pretrain_gpt.py with Megatron-LM's Llama flag block (``LLAMA_FLAGS``) as a subprocess (bf16)
  ours-llama-fp8      the same with ``--fp8-format hybrid`` (plus ``--ours-fp8-args``)
  hf-llama-compiled   transformers LlamaForCausalLM, SDPA, torch.compile, bf16 autocast, fused AdamW
  megatron-core       Megatron-Core GPTModel with its local layer spec (no Transformer Engine)
  torchtitan          torchtitan's Llama 3 model, blocks under torch.compile
  torchtitan-fp8      the same with torchao's float8 linears (needs torchao)
The peers run ``bench/llama_peers.py`` (read it for their settings) in the Python given by
``--python TRAINER[,TRAINER]=PATH`` (default: this Python), without this repository on the path, so each can come
from its own environment or wheels.

The same tokens: the bundled corpus tokenised once with GPT-2's BPE (``bench/corpus.py``), read by our trainer
through ``--tokenizer-type NullTokenizer --vocab-size 128255`` (ids passed through; 128,255 ids plus the
end-of-document id = 128,256 embedding rows, Llama 3's vocabulary size), so every model has Llama 3's 128,256-row
embedding and output layer while the ids themselves are GPT-2's (all below 50,257). The peers get the micro-batches
our trainer reads, saved by this driver (``corpus.batches``), so iteration i of every trainer sees the same samples.
MFU = tokens/s x FLOPs per token / peak, the FLOPs from the model description our trainer builds at that shape
(``megatron.core.model_counts.flops_per_token``: matrix multiplications, forward + backward, grouped-query
attention and the gated MLP counted as they are), the dense bf16 peak for every row and the FP8 peak also for
the FP8 rows.

    python bench/llama_throughput.py --python megatron-core=/venvs/mcore/bin/python \\
        --python torchtitan,torchtitan-fp8=/venvs/titan/bin/python
    python bench/llama_throughput.py --shapes tiny --device cpu --trainers ours-llama,hf-llama-compiled \\
        --iters 2 --warmup 1 --results-dir /tmp/x                     # a check of the script on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from corpus import batches, prepare_dataset, trainer_context  # noqa: E402
from gpu_throughput import (BF16_PEAK_TFLOPS, FP8_PEAK_TFLOPS, _glue_values, comma_choices,  # noqa: E402
                            environment, merge_rows, ours_flags, run_ours)
from megatron.core.model_counts import flops_per_token  # noqa: E402

SHAPES = {
    "llama-1b": dict(num_layers=16, hidden_size=2048, num_heads=32, num_query_groups=8, ffn_hidden_size=8192,
                     seq_length=2048, micro_batch_size=4),
    "llama-3b": dict(num_layers=28, hidden_size=3072, num_heads=24, num_query_groups=8, ffn_hidden_size=8192,
                     seq_length=2048, micro_batch_size=4),
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2, ffn_hidden_size=256,
                 seq_length=128, micro_batch_size=2),  # CPU check
}
TRAINERS = ("ours-llama", "ours-llama-fp8", "torchtitan", "torchtitan-fp8", "megatron-core", "hf-llama-compiled")
FP8_TRAINERS = ("ours-llama-fp8", "torchtitan-fp8")
ROPE_THETA = 500000
VOCAB_FLAGS = "--tokenizer-type NullTokenizer --vocab-size 128255"  # 128,256 rows (module docstring)
# Megatron-LM's Llama-3 model flags (examples/pretrain_llama.sh), the sizes filled in per shape
LLAMA_FLAGS = ("--position-embedding-type rope --rotary-base {theta} --normalization RMSNorm --norm-epsilon 1e-5 "
               "--swiglu --ffn-hidden-size {ffn} --group-query-attention --num-query-groups {groups} "
               "--kv-channels {d} --disable-bias-linear --untie-embeddings-and-output-weights")
OURS_FP8_ARGS = "--fp8-format hybrid"


def llama_flags(shape: dict) -> str:
    return LLAMA_FLAGS.format(theta=ROPE_THETA, ffn=shape["ffn_hidden_size"], groups=shape["num_query_groups"],
                              d=shape["hidden_size"] // shape["num_heads"])


def trainer_argv(shape: dict, iters: int, warmup: int, data_prefix, extra: str = "") -> list:
    """The pretrain_gpt.py flags of ours-llama at ``shape`` (``extra`` appended; ``data_prefix=None``: mock data)."""
    return ours_flags(shape, iters, warmup, data_prefix, f"{llama_flags(shape)} {VOCAB_FLAGS} {extra}")


def model_spec(shape: dict):
    """The model description our trainer builds at ``shape`` (its parser, validation and padded vocabulary)."""
    ctx = trainer_context(trainer_argv(shape, 100, 0, None))
    return ctx.config.model.spec(ctx.padded_vocab_size)


def save_tokens(shape: dict, iters: int, warmup: int, data_prefix: str, path: str) -> None:
    """The micro-batches ours-llama reads in its ``warmup + iters`` iterations, as int64[n, b, s + 1]."""
    import torch

    it = batches(trainer_argv(shape, iters, warmup, data_prefix), num_workers=0)
    torch.save(torch.stack([next(it)["text"] for _ in range(iters + warmup)]), path)


def python_for(specs: list) -> dict:
    """``--python TRAINER[,TRAINER]=PATH`` -> {trainer: path}; one error line for an unknown trainer or path."""
    out = {}
    for spec in specs:
        names, sep, path = spec.partition("=")
        if not sep or not path:
            raise SystemExit(f"--python {spec!r}: expected TRAINER[,TRAINER]=PATH")
        for name in comma_choices("--python", names, [t for t in TRAINERS if not t.startswith("ours")]):
            out[name] = os.path.abspath(path)  # the runs start in a temporary folder
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise SystemExit(f"--python {spec!r}: {path} is not an executable file")
    return out


def run_peer(trainer: str, shape: dict, spec, a, tokens: str, python: str) -> tuple:
    """``bench/llama_peers.py`` in ``python``, without this repository on the path; returns (result, command)."""
    argv = [python, os.path.join(ROOT, "bench", "llama_peers.py"), "--trainer", trainer, "--tokens", tokens,
            "--layers", str(spec.num_layers), "--hidden", str(spec.hidden_size),
            "--heads", str(spec.num_attention_heads), "--groups", str(spec.num_query_groups),
            "--ffn", str(spec.ffn_hidden_size), "--seq", str(spec.seq_length), "--vocab", str(spec.padded_vocab_size),
            "--rope-theta", str(spec.rotary_base), "--iters", str(a.iters), "--warmup", str(a.warmup),
            "--device", a.device]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # `megatron` must be the peer's own
    print("+", " ".join(shlex.quote(x) for x in argv), flush=True)
    proc = subprocess.run(argv, cwd=tempfile.gettempdir(), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{trainer} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    shown = ["python"] + [os.path.relpath(x, ROOT) if x.startswith(ROOT) else x for x in argv[1:]]
    return json.loads(found[-1][len("BENCH_RESULT "):]), " ".join(shlex.quote(x) for x in shown)


def make_row(trainer: str, shape: dict, res: dict, command: str, fpt: float, peaks: tuple) -> dict:
    """A row with the keys of ``gpu_throughput.py``'s rows; ``mfu_fp8_peak`` only for the FP8 rows."""
    tokens = shape["micro_batch_size"] * shape["seq_length"] / (res["ms_per_iter"] / 1000)
    return {"trainer": trainer, "num_layers": shape["num_layers"], "hidden_size": shape["hidden_size"],
            "seq_length": shape["seq_length"], "micro_batch_size": shape["micro_batch_size"],
            "ms_per_iter": round(res["ms_per_iter"], 2), "tokens_per_s": round(tokens, 1),
            "mfu": round(tokens * fpt / (peaks[0] * 1e12), 4),
            "mfu_fp8_peak": round(tokens * fpt / (peaks[1] * 1e12), 4) if trainer in FP8_TRAINERS else None,
            "peak_mem_gib": None if res.get("peak_mem_gib") is None else round(res["peak_mem_gib"], 2),
            "command": command}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma list of {', '.join(TRAINERS)}")
    ap.add_argument("--shapes", default="llama-1b,llama-3b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5, help="untimed warm-up iterations (compilation included)")
    ap.add_argument("--micro-batch-size", type=int, default=0, help="micro-batch of every shape (0: the shape's)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a check of the script")
    ap.add_argument("--python", action="append", default=[], metavar="TRAINER[,TRAINER]=PATH",
                    help="the Python a peer runs in (default: this one)")
    ap.add_argument("--ours-args", default="", help="extra flags for both of our rows")
    ap.add_argument("--ours-fp8-args", default="", help=f"extra flags for ours-llama-fp8 (after {OURS_FP8_ARGS!r})")
    ap.add_argument("--bf16-peak-tflops", type=float, default=BF16_PEAK_TFLOPS)
    ap.add_argument("--fp8-peak-tflops", type=float, default=FP8_PEAK_TFLOPS)
    ap.add_argument("--data-prefix", default=None, help=".bin/.idx prefix (default: tokenise the bundled corpus)")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--log-dir", default=None, help="where to keep our trainer's full logs")
    a = ap.parse_args(_glue_values(sys.argv[1:]))
    trainers = comma_choices("--trainers", a.trainers, TRAINERS)
    shapes = comma_choices("--shapes", a.shapes, SHAPES)
    pythons = python_for(a.python)
    if a.data_prefix and not (os.path.exists(a.data_prefix + ".bin") and os.path.exists(a.data_prefix + ".idx")):
        raise SystemExit(f"--data-prefix {a.data_prefix}: expected {a.data_prefix}.bin and {a.data_prefix}.idx")
    os.makedirs(a.results_dir, exist_ok=True)
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench_llama_")
    data_prefix = a.data_prefix or prepare_dataset(work)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "env": environment(), "command": "python bench/llama_throughput.py " + " ".join(
                shlex.quote(x) for x in sys.argv[1:]),
            "peak_tflops": {"bf16": a.bf16_peak_tflops, "fp8": a.fp8_peak_tflops}}
    peaks = (a.bf16_peak_tflops, a.fp8_peak_tflops)
    out_json = os.path.join(a.results_dir, "gpu_throughput.json")
    rows, extras = [], {"note": "vocabulary 128,256 (Llama 3's) over GPT-2 token ids (bench/llama_throughput.py).",
                        "flops_per_token": {}, "versions": {}, "losses": {}, "errors": {}}
    for shape_name in shapes:
        shape = dict(SHAPES[shape_name], micro_batch_size=a.micro_batch_size or SHAPES[shape_name]["micro_batch_size"])
        spec = model_spec(shape)
        fpt = flops_per_token(spec)
        size = f"{shape['num_layers']}x{shape['hidden_size']}"
        extras["flops_per_token"][size] = fpt
        tokens = os.path.join(work, f"tokens_{shape_name}.pt")
        if any(not t.startswith("ours") for t in trainers):
            save_tokens(shape, a.iters, a.warmup, data_prefix, tokens)
        for trainer in trainers:
            key, t0 = f"{trainer}/{size}", time.time()
            try:
                if trainer.startswith("ours"):
                    extra = f"{llama_flags(shape)} {VOCAB_FLAGS} {a.ours_args}"
                    if trainer == "ours-llama-fp8":
                        extra += f" {OURS_FP8_ARGS} {a.ours_fp8_args}"
                    res = run_ours(shape_name, a.iters, a.warmup, data_prefix, extra.strip(), a.log_dir, trainer,
                                   shape=shape)
                    cmd = res["command"]
                else:
                    res, cmd = run_peer(trainer, shape, spec, a, tokens, pythons.get(trainer, sys.executable))
                    extras["versions"][trainer] = res.get("versions")
                extras["losses"][key] = res.get("losses")
            except Exception as exc:  # keep measuring the others; the failure is recorded
                print(f"!! {key} failed: {exc}", flush=True)
                extras["errors"][key] = str(exc)[-2000:]
                continue
            row = make_row(trainer, shape, res, cmd, fpt, peaks)
            rows.append(row)
            print(f"{key}: {row['ms_per_iter']:.1f} ms/iter, {row['tokens_per_s']:,.0f} tok/s, MFU "
                  f"{100 * row['mfu']:.1f}% of the bf16 peak, peak {row['peak_mem_gib']} GiB "
                  f"({time.time() - t0:.0f} s)", flush=True)
            merge_rows(out_json, meta, rows, extras, "llama")  # after every row: a later failure keeps these
    merge_rows(out_json, meta, rows, extras, "llama")
    if extras["errors"]:
        raise SystemExit(f"failed rows: {', '.join(extras['errors'])}")


if __name__ == "__main__":
    main()
