"""Dropout under tensor parallelism: is the TP=2 loss curve statistically indistinguishable from TP=1?

With dropout on, TP=1 and TP=2 draw different masks (attention dropout uses the per-TP-rank generator), so the
curves differ run to run; what must hold is that the difference between layouts is no larger than the
difference between seeds. For each layout we train the same tiny GPT with several seeds and compare the mean
loss over the last iterations with Welch's t statistic, and report the per-iteration gap between the two mean
curves next to the seed-to-seed standard deviation.

    python bench/experiments/tp_dropout_check.py --seeds 4 --iters 60   # writes results/tp_dropout.md here
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
from tests.functional.harness import gpt_args, losses, preprocess_quickstart_corpus  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tp_dropout.md"))
    a = ap.parse_args()
    data = preprocess_quickstart_corpus(tempfile.mkdtemp())
    curves = {}
    for tp in (1, 2):
        curves[tp] = []
        for seed in range(a.seeds):
            run = losses(gpt_args(data, tp=tp, seed=1000 + seed, train_iters=a.iters, attention_dropout=0.1,
                                  hidden_dropout=0.1, lr_decay_style="constant", lr=1e-3), nproc=tp)
            curves[tp].append([run[i]["lm loss"] for i in sorted(run)])
            print(f"tp={tp} seed={seed} final={curves[tp][-1][-1]:.4f}", flush=True)
    tail = {tp: [statistics.mean(c[-a.window:]) for c in curves[tp]] for tp in curves}
    m1, m2 = statistics.mean(tail[1]), statistics.mean(tail[2])
    v1, v2 = statistics.variance(tail[1]), statistics.variance(tail[2])
    t = (m1 - m2) / ((v1 / len(tail[1]) + v2 / len(tail[2])) ** 0.5)
    gaps, spreads = [], []
    for i in range(a.iters):
        c1 = [c[i] for c in curves[1]]
        c2 = [c[i] for c in curves[2]]
        gaps.append(abs(statistics.mean(c1) - statistics.mean(c2)))
        spreads.append(statistics.stdev(c1 + c2))
    verdict = "indistinguishable" if abs(t) < 2.45 else "DIFFERENT"  # two-sided 5% for ~6 degrees of freedom
    lines = [
        "# Dropout under tensor parallelism: TP=2 vs TP=1",
        "",
        f"- date: {datetime.date.today()}, machine: {platform.machine()} {os.cpu_count()} cores, CPU/gloo",
        f"- command: `python bench/tp_dropout_check.py --seeds {a.seeds} --iters {a.iters} --window {a.window}`",
        "- model: the functional-test GPT (4 layers, hidden 64, seq 32, global batch 8), attention and hidden "
        "dropout 0.1, constant lr 1e-3",
        "",
        f"| layout | mean loss over the last {a.window} iterations, per seed | mean |",
        "|---|---|---|",
        f"| TP=1 | {', '.join(f'{x:.4f}' for x in tail[1])} | {m1:.4f} |",
        f"| TP=2 | {', '.join(f'{x:.4f}' for x in tail[2])} | {m2:.4f} |",
        "",
        f"Welch t = {t:.2f} ({verdict} at the 5% level); mean per-iteration gap between the layouts' mean curves "
        f"{statistics.mean(gaps):.4f} vs mean seed-to-seed standard deviation {statistics.mean(spreads):.4f}.",
    ]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
