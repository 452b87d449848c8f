"""BERT throughput and MFU: our pretrain_bert.py against Hugging Face BertForPreTraining, same shapes and tokens.

Trainers (``--trainers``): ``ours-bert`` (pretrain_bert.py as a subprocess, bf16, its iteration log lines parsed
and the first ``--warmup`` iterations skipped) and ``hf-bert`` (transformers ``BertForPreTraining``, SDPA
attention, bf16 autocast, fused AdamW on a GPU). Both train the masked-LM + sentence-order objective on the same
micro-batches: the bundled corpus split into sentences and tokenised once with the WordPiece ``--vocab-file``
(``tools/preprocess_data.py --split-sentences``), read through the library's BERT dataset and pretraining data
loader with the flags our trainer gets (``bench/corpus.py``), so iteration i of both sees the same samples.

Shapes (``--shapes``): ``large`` (BERT-large, 336M: 24 layers, h 1024, 16 heads, seq 512, micro-batch 16) and
``tiny`` (2 layers, h 64, seq 64) to check the script on a machine without a GPU (fp32 on the CPU; no meaningful
MFU). Dropout 0, AdamW, clip-grad 1.0; the vocabulary is padded to a multiple of 128 for both.

MFU = tokens/s x model FLOPs per token / peak (``--bf16-peak-tflops``, 989 for H100/H200 SXM), tokens = micro-batch
x sequence length (padded positions included: both trainers compute them), and FLOPs per training token

    72 L h^2 + 12 L h s + 6 h V + 6 h^2

(Megatron's count for the encoder with a 4h MLP and the vocabulary projection of every position, plus the MLM
head's h x h transform; the pooler and binary head, once per sample, are left out).

Rows have the keys of ``bench/gpu_throughput.py``'s rows and are merged into ``bench/results/gpu_throughput.json``
(the other trainers' rows are kept; a row of the same trainer and shape is replaced), with the Markdown table
rewritten beside it.

    python bench/bert_throughput.py --vocab-file ../shared/data/bert/vocab.txt           # on the GPU
    python bench/bert_throughput.py --shapes tiny --iters 2 --warmup 1 --results-dir /tmp/bert_bench  # CPU check
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

from corpus import NUM_WORKERS, SEED, SPLIT, bert_batches, prepare_bert_dataset  # noqa: E402
from gpu_throughput import (BF16_PEAK_TFLOPS, FP8_PEAK_TFLOPS, environment, parse_ours_log,  # noqa: E402
                            write_results)

SHAPES = {
    "large": dict(num_layers=24, hidden_size=1024, num_heads=16, seq_length=512, micro_batch_size=16),
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=64, micro_batch_size=2),  # CPU check
}
TRAINERS = ("ours-bert", "hf-bert")
DEFAULT_VOCAB = os.path.join(os.path.dirname(ROOT), "shared", "data", "bert", "vocab.txt")
OURS_BASE_ARGS = (
    "--bf16 --lr 1e-4 --min-lr 1e-5 --lr-decay-style linear --lr-warmup-iters 2 --weight-decay 1e-2 "
    "--clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --tokenizer-type BertWordPieceLowerCase "
    "--make-vocab-size-divisible-by 128 "
    f"--split {SPLIT} --eval-iters 0 --log-interval 1 --log-throughput --seed {SEED} --num-workers {NUM_WORKERS}"
)


def padded_vocab(vocab_file: str) -> int:
    """The vocabulary both trainers use: the tokenizer's (vocab.txt + [BOS] [EOS]) padded to a multiple of 128."""
    from megatron.core.tokenizer import build_tokenizer
    from megatron.training.config import pad_vocab_size

    return pad_vocab_size(build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_file).vocab_size, 128, 1)


def flops_per_token(L: int, h: int, s: int, V: int) -> float:
    """Model FLOPs per token of one BERT training iteration (module doc)."""
    return 72 * L * h * h + 12 * L * h * s + 6 * h * V + 6 * h * h


# ---------------------------------------------------------------------------------------------------------------
# hf-bert (child process: ``--worker hf-bert --shape NAME``)
# ---------------------------------------------------------------------------------------------------------------
def hf_model(shape: dict, vocab_size: int):
    import torch
    from transformers import BertConfig, BertForPreTraining

    h = shape["hidden_size"]
    cfg = BertConfig(vocab_size=vocab_size, hidden_size=h, num_hidden_layers=shape["num_layers"],
                     num_attention_heads=shape["num_heads"], intermediate_size=4 * h,
                     max_position_embeddings=shape["seq_length"], type_vocab_size=2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = BertForPreTraining._from_config(cfg, attn_implementation="sdpa")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise RuntimeError(f"transformers picked attention implementation {impl!r}, not sdpa")
    return model


def run_hf(shape_name: str, iters: int, warmup: int, data_prefix: str, vocab_file: str) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    shape = SHAPES[shape_name]
    model = hf_model(shape, padded_vocab(vocab_file))
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-2, fused=cuda)
    data = bert_batches(data_prefix, vocab_file, shape["seq_length"], shape["micro_batch_size"], warmup + iters)
    losses, t0 = [], None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for it in range(warmup + iters):
        if it == warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        b = {k: v.to(device, non_blocking=True) for k, v in next(data).items()}
        labels = b["labels"].masked_fill(b["loss_mask"] == 0, -100)  # HF ignores -100
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = model(input_ids=b["text"], attention_mask=b["padding_mask"], token_type_ids=b["types"],
                        labels=labels, next_sentence_label=b["is_random"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach())
    if cuda:
        torch.cuda.synchronize()
    return {"ms_per_iter": 1000 * (time.perf_counter() - t0) / iters,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "losses": [x.item() for x in losses]}


# ---------------------------------------------------------------------------------------------------------------
# ours-bert: pretrain_bert.py through gpu_throughput.py's wrapper (it reports the peak memory)
# ---------------------------------------------------------------------------------------------------------------
def ours_command(shape: dict, iters: int, warmup: int, data_prefix: str, vocab_file: str, extra: str) -> list:
    s = shape
    args = (f"--num-layers {s['num_layers']} --hidden-size {s['hidden_size']} --num-attention-heads {s['num_heads']} "
            f"--seq-length {s['seq_length']} --max-position-embeddings {s['seq_length']} "
            f"--micro-batch-size {s['micro_batch_size']} --global-batch-size {s['micro_batch_size']} "
            f"--train-iters {iters + warmup} --data-path {data_prefix} --vocab-file {vocab_file} "
            f"{OURS_BASE_ARGS} {extra}")
    return [sys.executable, os.path.join(ROOT, "bench", "gpu_throughput.py"), "--run-ours", "--",
            os.path.join(ROOT, "pretrain_bert.py")] + shlex.split(args)


def run_ours(shape_name: str, a, data_prefix: str) -> tuple:
    cmd = ours_command(SHAPES[shape_name], a.iters, a.warmup, data_prefix, a.vocab_file, a.ours_args)
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain_bert.py exited with {proc.returncode}:\n{proc.stdout[-4000:]}")
    return parse_ours_log(proc.stdout, a.warmup), "python pretrain_bert.py " + " ".join(
        shlex.quote(c) for c in cmd[5:])


def run_peer(shape_name: str, a, data_prefix: str) -> tuple:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "hf-bert", "--shape", shape_name,
            "--iters", str(a.iters), "--warmup", str(a.warmup), "--data-prefix", data_prefix,
            "--vocab-file", a.vocab_file]
    proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    cmd = (f"python bench/bert_throughput.py --worker hf-bert --shape {shape_name} --iters {a.iters} "
           f"--warmup {a.warmup}")
    return json.loads(found[-1][len("BENCH_RESULT "):]), cmd


def make_row(trainer: str, shape_name: str, res: dict, command: str, vocab: int, peak_tflops: float) -> dict:
    """A row with the keys of gpu_throughput.py's rows."""
    s = SHAPES[shape_name]
    L, h, seq = s["num_layers"], s["hidden_size"], s["seq_length"]
    tokens = s["micro_batch_size"] * seq / (res["ms_per_iter"] / 1000)
    return {"trainer": trainer, "num_layers": L, "hidden_size": h, "seq_length": seq,
            "micro_batch_size": s["micro_batch_size"], "ms_per_iter": round(res["ms_per_iter"], 2),
            "tokens_per_s": round(tokens, 1),
            "mfu": round(tokens * flops_per_token(L, h, seq, vocab) / (peak_tflops * 1e12), 4),
            "mfu_fp8_peak": None,
            "peak_mem_gib": None if res.get("peak_mem_gib") is None else round(res["peak_mem_gib"], 2),
            "command": command}


def merge_rows(path_json: str, meta: dict, rows: list, extras: dict) -> None:
    """Put ``rows`` into the results file (replacing rows of the same trainer and shape, keeping the rest)."""
    old = {}
    if os.path.exists(path_json):
        with open(path_json) as f:
            old = json.load(f)
    keys = {(r["trainer"], r["num_layers"], r["hidden_size"]) for r in rows}
    kept = [r for r in old.get("rows", []) if (r["trainer"], r["num_layers"], r["hidden_size"]) not in keys]
    merged_extras = old.get("extras", {})
    merged_extras["bert"] = extras
    merged_meta = {**meta, **{k: v for k, v in old.items() if k not in ("rows", "extras")}} if old else meta
    merged_meta["bert_command"] = meta["command"]
    merged_meta["bert_date"] = meta["date"]
    write_results(path_json, merged_meta, kept + rows, merged_extras)


def main() -> None:
    ap = argparse.ArgumentParser(description="BERT throughput/MFU: ours against HF BertForPreTraining, same tokens.")
    ap.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma list of {', '.join(TRAINERS)}")
    ap.add_argument("--shapes", default="large", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=15, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5, help="untimed warm-up iterations")
    ap.add_argument("--vocab-file", default=DEFAULT_VOCAB, help="WordPiece vocab.txt (bert-base/large-uncased)")
    ap.add_argument("--ours-args", default="", help="extra flags for pretrain_bert.py (glue with =)")
    ap.add_argument("--bf16-peak-tflops", type=float, default=BF16_PEAK_TFLOPS)
    ap.add_argument("--data-prefix", default=None, help="_text_sentence prefix (default: the bundled corpus)")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not os.path.exists(a.vocab_file):
        raise SystemExit(f"--vocab-file {a.vocab_file}: no such file (a WordPiece vocab.txt)")
    if a.worker:
        print("BENCH_RESULT " + json.dumps(run_hf(a.shape, a.iters, a.warmup, a.data_prefix, a.vocab_file)),
              flush=True)
        return
    trainers = [t for t in a.trainers.split(",") if t]
    shapes = [s for s in a.shapes.split(",") if s]
    for t in trainers:
        if t not in TRAINERS:
            raise SystemExit(f"--trainers: unknown trainer {t!r}; choose from {', '.join(TRAINERS)}")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    data_prefix = a.data_prefix or prepare_bert_dataset(tempfile.mkdtemp(prefix="bench_bert_"), a.vocab_file)
    vocab = padded_vocab(a.vocab_file)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "env": environment(), "command": "python bench/bert_throughput.py " + " ".join(
                shlex.quote(x) for x in sys.argv[1:]),
            "peak_tflops": {"bf16": a.bf16_peak_tflops, "fp8": FP8_PEAK_TFLOPS}}
    os.makedirs(a.results_dir, exist_ok=True)
    out_json = os.path.join(a.results_dir, "gpu_throughput.json")
    rows, extras = [], {"losses": {}, "errors": {}, "flops_per_token": "72 L h^2 + 12 L h s + 6 h V + 6 h^2",
                        "padded_vocab": vocab}
    for shape_name in shapes:
        for trainer in trainers:
            key = f"{trainer}/{SHAPES[shape_name]['num_layers']}x{SHAPES[shape_name]['hidden_size']}"
            try:
                res, cmd = run_ours(shape_name, a, data_prefix) if trainer == "ours-bert" else \
                    run_peer(shape_name, a, data_prefix)
            except Exception as exc:  # keep measuring the other; the failure is recorded
                print(f"!! {key} failed: {exc}", flush=True)
                extras["errors"][key] = str(exc)[-2000:]
                continue
            extras["losses"][key] = res.get("losses")
            row = make_row(trainer, shape_name, res, cmd, vocab, a.bf16_peak_tflops)
            rows.append(row)
            print(f"{key}: {row['ms_per_iter']:.1f} ms/iter, {row['tokens_per_s']:,.0f} tok/s, "
                  f"MFU {100 * row['mfu']:.1f}% of the bf16 peak, peak {row['peak_mem_gib']} GiB", flush=True)
    merge_rows(out_json, meta, rows, extras)
    if extras["errors"]:
        raise SystemExit(f"failed rows: {', '.join(extras['errors'])}")


if __name__ == "__main__":
    main()
