"""Fine-tuning speed at the BERT-large shape: ``tasks/main.py --task MNLI`` against Hugging Face
``BertForSequenceClassification`` (SDPA attention, ``torch.autocast`` to bf16, AdamW) on the same padded batches.

    python bench/finetune_throughput.py --vocab-file VOCAB.txt                 # one GPU, bf16, BERT-large
    python bench/finetune_throughput.py --shape tiny --device cpu --iters 3 --warmup 1 --results-dir /tmp/x

Both start from random weights (speed does not depend on them) and read the same generated MNLI-layout pairs, long
enough to fill every sequence, through the library's fine-tuning dataset (``[CLS] A [SEP] B [SEP]``, padded to
the sequence length), in the same order. Ours is ``tasks/main.py`` with ``--bf16`` (bf16 parameters, fp32 main
weights and gradients); its time per iteration is read from its own log line. Hugging Face's is the recipe of
``finetune_hf_reference.py`` with autocast, timed between iteration ends (the device synchronised). The median of
the iterations after ``--warmup`` is reported for each, with tokens/s counting the padded tokens (the same for both).
Writes ``bench/results/finetune_throughput.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

SHAPES = {  # layers, hidden, heads, FFN, seq, micro-batch
    "large": {"layers": 24, "hidden": 1024, "heads": 16, "ffn": 4096, "seq": 128, "batch": 32},
    "tiny": {"layers": 2, "hidden": 64, "heads": 4, "ffn": 256, "seq": 32, "batch": 8},
}
ITERATION_MS = re.compile(r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def write_pairs(path: str, words: list, n: int, seed: int = 0) -> str:
    """``n`` MNLI-layout pairs of random words, each sentence long enough to fill the sequence."""
    import numpy as np

    rng = np.random.RandomState(seed)
    labels = ("contradiction", "entailment", "neutral")
    with open(path, "w") as f:
        f.write("\t".join(["index"] + [""] * 7 + ["sentence1", "sentence2", "label1", "gold_label"]) + "\n")
        for i in range(n):
            label = labels[rng.randint(3)]
            f.write("\t".join([str(i)] + [""] * 7 + [" ".join(rng.choice(words, 80)), " ".join(rng.choice(words, 80)),
                                                    label, label]) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-file", default=None,
                    help="WordPiece vocab.txt (default: generated, of BERT's 30,522 entries)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="large")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations before them")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    import torch
    import transformers

    from finetune_hf_reference import hf_train
    from megatron.core.datasets.finetune_data import build_dataset
    from megatron.core.tokenizer import build_tokenizer
    from results_io import run_meta, write_results

    s = SHAPES[a.shape]
    work = tempfile.mkdtemp(prefix="finetune_throughput_")
    vocab = a.vocab_file
    if vocab is None:
        vocab = os.path.join(work, "vocab.txt")
        with open(vocab, "w") as f:
            f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(30517)]) + "\n")
    with open(vocab) as f:
        words = [w for w in (line.strip() for line in f) if w and not w.startswith(("[", "##"))][:5000]
    iters = a.warmup + a.iters
    train = write_pairs(os.path.join(work, "train.tsv"), words, iters * s["batch"])
    dev = write_pairs(os.path.join(work, "dev.tsv"), words, s["batch"], seed=1)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, os.path.join(ROOT, "tasks/main.py"), "--task", "MNLI", "--train-data", train,
           "--valid-data", dev, "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
           "--num-attention-heads", str(s["heads"]), "--ffn-hidden-size", str(s["ffn"]), "--seq-length",
           str(s["seq"]), "--max-position-embeddings", "512", "--micro-batch-size", str(s["batch"]),
           "--global-batch-size", str(s["batch"]), "--epochs", "1", "--lr", "2e-5", "--lr-warmup-fraction", "0.1",
           "--weight-decay", "0.01", "--clip-grad", "1.0", "--bf16", "--log-interval", "1", "--eval-interval",
           "100000", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab, "--seed", "1234"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tasks/main.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    ours_ms = [float(ms) for it, ms in ITERATION_MS.findall(proc.stdout) if int(it) > a.warmup]
    if len(ours_ms) != a.iters:
        raise SystemExit(f"expected {a.iters} timed iterations in tasks/main.py's log, found {len(ours_ms)}")

    device = torch.device(a.device)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab)
    ds = build_dataset("MNLI", [train], tok, s["seq"])
    torch.manual_seed(1234)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                                  num_attention_heads=s["heads"], intermediate_size=s["ffn"],
                                  max_position_embeddings=512, num_labels=3, attn_implementation="sdpa")
    model = transformers.BertForSequenceClassification(cfg).to(device)
    ends = []

    def mark(i, n, loss):
        if device.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    hf_train(model, ds, 1234, 1, s["batch"], 2e-5, 0.1, 0.01, 1.0, log=mark, autocast=torch.bfloat16)
    hf_ms = [1000 * (b - e) for e, b in zip(ends[a.warmup - 1:], ends[a.warmup:])] if a.warmup else []
    if len(hf_ms) != a.iters:
        raise SystemExit("--warmup must be at least 1 (Hugging Face's iterations are timed between their ends)")
    tokens = s["batch"] * s["seq"]
    rows = []
    for name, ms in (("ours (tasks/main.py --bf16)", ours_ms), ("hf BertForSequenceClassification (autocast bf16, "
                                                                "SDPA)", hf_ms)):
        med = statistics.median(ms)
        rows.append({"trainer": name, "shape": a.shape, **s, "ms_per_iteration": ms, "median_ms": round(med, 2),
                     "tokens_per_s": round(tokens / med * 1000)})
    ratio = rows[1]["median_ms"] / rows[0]["median_ms"]
    body = [f"Shape {a.shape}: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, FFN {s['ffn']}, seq "
            f"{s['seq']}, batch {s['batch']}; {a.warmup} untimed then {a.iters} timed iterations each; device "
            f"{a.device}; transformers {transformers.__version__}.", "",
            "| trainer | median ms/iteration | tokens/s (padded) |", "|---|---|---|"]
    body += [f"| {r['trainer']} | {r['median_ms']} | {r['tokens_per_s']:,} |" for r in rows]
    body += ["", f"Ours {ratio:.2f}x Hugging Face's tokens/s.", "",
             f"tasks/main.py command: `python tasks/main.py {' '.join(cmd[2:])}`".replace(work, "$WORK")]
    write_results(a.results_dir, "finetune_throughput", {**run_meta("finetune_throughput.py"), "ratio": ratio},
                  rows, "BERT fine-tuning throughput", body)
    print("\n".join(body))


if __name__ == "__main__":
    main()
