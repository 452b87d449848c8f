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

    72 L h^2 + 12 L h s + (6 h V + 6 h^2) k / s,    k = floor(0.15 s)

(Megatron's count for the encoder with a 4h MLP, plus the MLM head, the h x h transform and the projection onto the
vocabulary, at the k positions per sample the masked-LM objective can need: the datasets mask at most k; the
pooler and binary head, once per sample, are left out). The same count for both trainers: ours runs the MLM head
on those k positions only, HF runs it on all s, and the extra work is not counted as model FLOPs.

Rows have the keys of ``bench/gpu_throughput.py``'s rows and are merged into ``bench/results/gpu_throughput.json``
(the other trainers' rows are kept; a row of the same trainer and shape is replaced), with the Markdown table
rewritten beside it.

``--variant LABEL:FLAGS`` (repeatable) runs ours-bert once per variant with FLAGS added, as rows
``ours-bert[LABEL]``: the eager trainer and the whole step captured as a CUDA graph in one run, next to HF::

    python bench/bert_throughput.py --vocab-file V --data-prefix P --variant eager: \
        --variant "graph:--enable-cuda-graph --cuda-graph-warmup-steps 2"

Every input is a flag (``--vocab-file``, ``--corpus`` or ``--data-prefix``, ``--results-dir``), so the benchmark
runs on a machine without network or shared data. Each trainer's output is echoed as it comes (the HF peer prints
one line per iteration), each trainer has ``--trainer-timeout`` seconds, and the results file is rewritten after
every trainer, so a failed or stopped trainer leaves the others' rows (its error is recorded in the extras).
The defaults (micro-batch 16, 5 + 15 iterations per trainer) are sized for well under five minutes on one H100/H200.

    python bench/bert_throughput.py --vocab-file scratch/vocab.txt                      # on the GPU
    python bench/bert_throughput.py --shapes tiny --iters 2 --warmup 1 --vocab-file V --results-dir /tmp/bb  # CPU
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
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from corpus import NUM_WORKERS, SEED, SPLIT, bert_batches, prepare_bert_dataset  # noqa: E402
from gpu_throughput import (BF16_PEAK_TFLOPS, FP8_PEAK_TFLOPS, _glue_values, comma_choices,  # noqa: E402
                            environment, merge_rows, parse_ours_log)
from megatron.core.model_counts import flops_per_token as spec_flops_per_token  # noqa: E402
from megatron.core.model_spec import ModelSpec  # noqa: E402
from megatron.core.models.bert_loss import max_masked_positions  # noqa: E402

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


def flops_per_token(L: int, h: int, s: int, V: int, mask_prob: float = 0.15) -> float:
    """Model FLOPs per token of one BERT training iteration (module doc): the encoder as in the library's count
    (the trainer's log line), and the MLM head (h x h transform and vocabulary projection) at the k masked
    positions per sample the objective can need."""
    encoder = ModelSpec(num_layers=L, hidden_size=h, num_attention_heads=1, seq_length=s, padded_vocab_size=V)
    with_full_projection = spec_flops_per_token(encoder)  # includes 6 h V at every position
    k = max_masked_positions(mask_prob, s)
    return with_full_projection - 6 * h * V + (6 * h * V + 6 * h * h) * k / s


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


def run_hf(shape_name: str, iters: int, warmup: int, data_prefix: str, vocab_file: str,
           micro_batch_size: int) -> dict:
    """HF BertForPreTraining through the GPT peers' timing loop (``minimal_gpt.train_and_time``), with our
    trainer's AdamW settings (betas 0.9/0.999, weight decay 0.01)."""
    import torch
    from minimal_gpt import train_and_time

    torch.backends.cuda.matmul.allow_tf32 = True
    shape = SHAPES[shape_name]
    model = hf_model(shape, padded_vocab(vocab_file))
    data = bert_batches(data_prefix, vocab_file, shape["seq_length"], micro_batch_size, warmup + iters)

    def loss_of_batch(b):
        labels = b["labels"].masked_fill(b["loss_mask"] == 0, -100)  # HF ignores -100
        return model(input_ids=b["text"], attention_mask=b["padding_mask"], token_type_ids=b["types"],
                     labels=labels, next_sentence_label=b["is_random"]).loss

    return train_and_time(model, None, data, iters, warmup, loss_of_batch=loss_of_batch,
                          adamw={"betas": (0.9, 0.999), "weight_decay": 1e-2}, label="hf-bert")


def stream(cmd: list, timeout: float, tag: str) -> tuple:
    """Run ``cmd``, echoing its output line by line as ``[tag] ...``; ``(returncode, output)``. Past ``timeout``
    seconds the child is killed and the return code is None."""
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, deadline = [], time.time() + timeout
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            print(f"[{tag}] {line}", end="", flush=True)
        proc.wait()
    finally:
        timer.cancel()
    code = None if time.time() >= deadline and proc.returncode != 0 else proc.returncode
    return code, "".join(lines)


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


def parse_variants(specs: list) -> list:
    """``[(label, flags)]`` of the ``--variant LABEL:FLAGS`` options, or ``[("", "")]`` (one plain run)."""
    variants = [tuple(v.partition(":")[::2]) for v in specs]
    if any(not label for label, _ in variants):
        raise SystemExit("--variant: expected LABEL:FLAGS with a non-empty LABEL, e.g. 'graph:--enable-cuda-graph'")
    labels = [label for label, _ in variants]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--variant: each LABEL once, got {', '.join(labels)}")
    return variants or [("", "")]


def run_ours(shape: dict, a, data_prefix: str, flags: str = "", name: str = "ours-bert") -> tuple:
    cmd = ours_command(shape, a.iters, a.warmup, data_prefix, a.vocab_file, f"{a.ours_args} {flags}".strip())
    code, log = stream(cmd, a.trainer_timeout, name)
    if code != 0:
        why = f"exited with {code}" if code is not None else f"stopped after --trainer-timeout {a.trainer_timeout} s"
        raise RuntimeError(f"pretrain_bert.py {why}:\n{log[-4000:]}")
    return parse_ours_log(log, a.warmup), "python pretrain_bert.py " + " ".join(shlex.quote(c) for c in cmd[5:])


def run_peer(shape_name: str, shape: dict, a, data_prefix: str) -> tuple:
    tail = ["--shape", shape_name, "--micro-batch-size", str(shape["micro_batch_size"]), "--iters", str(a.iters),
            "--warmup", str(a.warmup), "--data-prefix", data_prefix, "--vocab-file", a.vocab_file]
    code, log = stream([sys.executable, os.path.abspath(__file__), "--worker", "hf-bert"] + tail, a.trainer_timeout,
                       "hf-bert")
    found = [ln for ln in log.splitlines() if ln.startswith("BENCH_RESULT ")]
    if code != 0 or not found:
        why = f"exited with {code}" if code is not None else f"stopped after --trainer-timeout {a.trainer_timeout} s"
        raise RuntimeError(f"the hf-bert worker {why}:\n{log[-4000:]}")
    cmd = "python bench/bert_throughput.py --worker hf-bert " + " ".join(shlex.quote(c) for c in tail)
    return json.loads(found[-1][len("BENCH_RESULT "):]), cmd


def make_row(trainer: str, shape: dict, res: dict, command: str, vocab: int, peak_tflops: float) -> dict:
    """A row with the keys of gpu_throughput.py's rows."""
    L, h, seq, mb = shape["num_layers"], shape["hidden_size"], shape["seq_length"], shape["micro_batch_size"]
    tokens = mb * seq / (res["ms_per_iter"] / 1000)
    return {"trainer": trainer, "num_layers": L, "hidden_size": h, "seq_length": seq,
            "micro_batch_size": mb, "ms_per_iter": round(res["ms_per_iter"], 2),
            "tokens_per_s": round(tokens, 1),
            "mfu": round(tokens * flops_per_token(L, h, seq, vocab) / (peak_tflops * 1e12), 4),
            "mfu_fp8_peak": None,
            "peak_mem_gib": None if res.get("peak_mem_gib") is None else round(res["peak_mem_gib"], 2),
            "command": command}


def main() -> None:
    ap = argparse.ArgumentParser(description="BERT throughput/MFU: ours against HF BertForPreTraining, same tokens.")
    ap.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma list of {', '.join(TRAINERS)}")
    ap.add_argument("--shapes", default="large", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=15, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5, help="untimed warm-up iterations")
    ap.add_argument("--micro-batch-size", type=int, default=0, help="micro-batch of every shape (0: the shape's)")
    ap.add_argument("--vocab-file", default=DEFAULT_VOCAB, help="WordPiece vocab.txt (bert-base/large-uncased)")
    ap.add_argument("--corpus", default=None,
                    help="loose-JSON corpus (.jsonl or .jsonl.gz) to split and tokenise (default: the bundled one)")
    ap.add_argument("--data-prefix", default=None, help="an already tokenised _text_sentence prefix (skips --corpus)")
    ap.add_argument("--ours-args", default="", help="extra flags for pretrain_bert.py")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:FLAGS",
                    help="run ours-bert once per variant with FLAGS added; rows named ours-bert[LABEL], e.g. "
                         "'eager:' and 'graph:--enable-cuda-graph'")
    ap.add_argument("--trainer-timeout", type=float, default=150.0, help="seconds each trainer may run")
    ap.add_argument("--bf16-peak-tflops", type=float, default=BF16_PEAK_TFLOPS)
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(_glue_values(sys.argv[1:]))
    if not os.path.exists(a.vocab_file):
        raise SystemExit(f"--vocab-file {a.vocab_file}: no such file (a WordPiece vocab.txt)")
    if a.corpus and not os.path.exists(a.corpus):
        raise SystemExit(f"--corpus {a.corpus}: no such file (loose JSON, one {{\"text\": ...}} per line)")
    if a.worker:
        res = run_hf(a.shape, a.iters, a.warmup, a.data_prefix, a.vocab_file,
                     a.micro_batch_size or SHAPES[a.shape]["micro_batch_size"])
        print("BENCH_RESULT " + json.dumps(res), flush=True)
        return
    trainers = comma_choices("--trainers", a.trainers, TRAINERS)
    shapes = comma_choices("--shapes", a.shapes, SHAPES)
    variants = parse_variants(a.variant)
    t0 = time.time()
    data_prefix = a.data_prefix or prepare_bert_dataset(tempfile.mkdtemp(prefix="bench_bert_"), a.vocab_file,
                                                        source=a.corpus)
    print(f"data ready in {time.time() - t0:.0f} s: {data_prefix}", flush=True)
    vocab = padded_vocab(a.vocab_file)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "env": environment(), "command": "python bench/bert_throughput.py " + " ".join(
                shlex.quote(x) for x in sys.argv[1:]),
            "peak_tflops": {"bf16": a.bf16_peak_tflops, "fp8": FP8_PEAK_TFLOPS}}
    os.makedirs(a.results_dir, exist_ok=True)
    out_json = os.path.join(a.results_dir, "gpu_throughput.json")
    rows, extras = [], {"losses": {}, "errors": {}, "flops_per_token": "72 L h^2 + 12 L h s + (6 h V + 6 h^2) k / s, k = floor(0.15 s)",
                        "padded_vocab": vocab}
    for shape_name in shapes:
        shape = dict(SHAPES[shape_name], micro_batch_size=a.micro_batch_size or SHAPES[shape_name]["micro_batch_size"])
        runs = [(f"{t}[{label}]" if label else t, t, flags)
                for t in trainers for label, flags in (variants if t == "ours-bert" else [("", "")])]
        for number, (name, trainer, flags) in enumerate(runs, 1):
            key = f"{name}/{shape['num_layers']}x{shape['hidden_size']}"
            print(f"== [{number}/{len(runs)}] {key}, micro-batch {shape['micro_batch_size']}, {a.warmup} + {a.iters} "
                  f"iterations{' with ' + flags if flags else ''} ({time.time() - t0:.0f} s since start)", flush=True)
            try:
                res, cmd = run_ours(shape, a, data_prefix, flags, name) if trainer == "ours-bert" else \
                    run_peer(shape_name, shape, a, data_prefix)
                row = make_row(name, shape, res, cmd, vocab, a.bf16_peak_tflops)
            except Exception as exc:  # keep measuring the others; the failure is recorded
                print(f"!! {key} failed: {str(exc).splitlines()[0]}", flush=True)
                extras["errors"][key] = str(exc)[-2000:]
            else:
                extras["losses"][key] = res.get("losses")
                if res.get("replay_ms"):  # --enable-cuda-graph: each timed replay's GPU time
                    extras.setdefault("replay_ms", {})[key] = res["replay_ms"]
                rows.append(row)
                print(f"{key}: {row['ms_per_iter']:.1f} ms/iter, {row['tokens_per_s']:,.0f} tok/s, "
                      f"MFU {100 * row['mfu']:.1f}% of the bf16 peak, peak {row['peak_mem_gib']} GiB", flush=True)
            merge_rows(out_json, meta, rows, extras, "bert")  # after every trainer: a later failure keeps these rows
        peer = [r for r in rows if r["trainer"] == "hf-bert" and r["num_layers"] == shape["num_layers"]]
        for r in rows:
            if peer and r["trainer"].startswith("ours-bert") and r["num_layers"] == shape["num_layers"]:
                print(f"{r['trainer']} / hf-bert tokens/s: {r['tokens_per_s'] / peer[0]['tokens_per_s']:.2f}x",
                      flush=True)
    print(f"wrote {out_json} ({time.time() - t0:.0f} s)", flush=True)
    if extras["errors"]:
        raise SystemExit(f"failed rows: {', '.join(extras['errors'])}")


if __name__ == "__main__":
    main()
