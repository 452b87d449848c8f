"""Our trainer's speed in two or more source trees, interleaved in one run on the GPU (an A/B of a change).

Each tree is a checkout of the project (a git worktree, or ``git archive REF | tar -x -C DIR`` for a copy that
travels with the working tree, e.g. to the GPU machine). For every case and round, each tree's own
``bench/gpu_throughput.py`` runs the case with that tree's code, the trees taking turns (base, new, base, new, ...),
so drifting clocks or temperature hit every side alike. All runs read one dataset, tokenised once.

    git archive REF | (mkdir -p scratch/base && tar -x -C scratch/base)
    python bench/ab_trees.py --tree base=scratch/base --tree new=. --rounds 2 \\
        --case "124m:ours-fp8:--enable-cuda-graph --fp8-recipe delayed" \\
        --case "1.3b:ours-fp8:--enable-cuda-graph --fp8-recipe delayed" --tag latest

A case is ``SHAPE:TRAINER:FLAGS``: TRAINER ``ours`` or ``ours-fp8`` at a shape of ``gpu_throughput.py`` (FLAGS go
to pretrain_gpt.py at that shape), or ``ours-bert`` at a shape of ``bert_throughput.py`` (``large``; FLAGS go to
pretrain_bert.py through its ``--ours-args``; the BERT corpus is tokenised once with ``--bert-vocab-file``), e.g.
``--case "large:ours-bert:" --case "large:ours-bert:--enable-cuda-graph"``.
Writes ``bench/results/ab_TAG.{json,md}``: every run's ms/iteration and MFU (against the dense bf16 peak, as in
gpu_throughput.py), the median per tree and case, and each tree's tokens/s relative to the first tree's (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bert_throughput import DEFAULT_VOCAB, SHAPES as BERT_SHAPES  # noqa: E402
from corpus import prepare_bert_dataset  # noqa: E402
from gpu_throughput import SHAPES, prepare_dataset  # noqa: E402
from results_io import run_meta, write_results  # noqa: E402

TRAINER_SHAPE_FLAG = {"ours": "--ours-shape-args", "ours-fp8": "--ours-fp8-shape-args"}


def parse_tree(spec: str):
    name, sep, path = spec.partition("=")
    if not sep or not name or not os.path.isfile(os.path.join(path, "bench", "gpu_throughput.py")):
        raise ValueError(f"--tree {spec!r}: expected NAME=PATH with PATH a checkout of the project "
                         "(PATH/bench/gpu_throughput.py)")
    return name, os.path.abspath(path)


def parse_case(spec: str):
    shape, _, rest = spec.partition(":")
    trainer, _, flags = rest.partition(":")
    bert = trainer == "ours-bert"
    if (shape not in (BERT_SHAPES if bert else SHAPES)) or not (bert or trainer in TRAINER_SHAPE_FLAG):
        raise ValueError(f"--case {spec!r}: expected SHAPE:TRAINER:FLAGS with TRAINER one of "
                         f"{', '.join(TRAINER_SHAPE_FLAG)} at SHAPE one of {', '.join(SHAPES)}, or TRAINER "
                         f"ours-bert at SHAPE one of {', '.join(BERT_SHAPES)}")
    return shape, trainer, flags.strip()


def run_one(tree: str, shape: str, trainer: str, flags: str, iters: int, warmup: int, data_prefix: str,
            workdir: str) -> dict:
    """One case in one tree; ``data_prefix`` is (GPT prefix, BERT prefix, its vocab.txt)."""
    out = tempfile.mkdtemp(dir=workdir)
    if trainer == "ours-bert":
        cmd = [sys.executable, os.path.join(tree, "bench", "bert_throughput.py"), "--trainers", trainer,
               "--shapes", shape, "--iters", str(iters), "--warmup", str(warmup), "--data-prefix", data_prefix[1],
               "--vocab-file", data_prefix[2], "--results-dir", out, f"--ours-args={flags}"]
        written = os.path.join(out, "gpu_throughput.json")
    else:
        cmd = [sys.executable, os.path.join(tree, "bench", "gpu_throughput.py"), "--trainers", trainer, "--shapes",
               shape, "--iters", str(iters), "--warmup", str(warmup), "--data-prefix", data_prefix[0], "--tag",
               "ab", "--results-dir", out, "--log-dir", out, f"{TRAINER_SHAPE_FLAG[trainer]}={shape}:{flags}"]
        written = os.path.join(out, "gpu_throughput_ab.json")
    proc = subprocess.run(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with open(written) as f:
            result = json.load(f)
    except FileNotFoundError:
        result = {"rows": [], "extras": {"errors": {"run": proc.stdout[-2000:]}}}
    if not result["rows"]:
        errors = result["extras"].get("bert", result["extras"]).get("errors", {})
        return {"error": (json.dumps(errors) if errors else proc.stdout)[-2000:]}
    row = result["rows"][0]
    return {"ms_per_iter": row["ms_per_iter"], "tokens_per_s": row["tokens_per_s"], "mfu": row["mfu"],
            "peak_mem_gib": row["peak_mem_gib"], "command": " ".join(shlex.quote(c) for c in cmd)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH, at least two; the first is the "
                    "baseline")
    ap.add_argument("--case", action="append", required=True, help="SHAPE:TRAINER:FLAGS")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tag", default="latest")
    ap.add_argument("--bert-vocab-file", default=DEFAULT_VOCAB, help="WordPiece vocab.txt of the ours-bert cases")
    ap.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    trees = [parse_tree(t) for t in a.tree]
    cases = [parse_case(c) for c in a.case]
    if len(trees) < 2 or len({n for n, _ in trees}) != len(trees):
        raise ValueError("--tree: give at least two trees with distinct names")
    meta = run_meta("ab_trees.py")
    workdir = tempfile.mkdtemp(prefix="ab_trees_")
    bert = any(trainer == "ours-bert" for _, trainer, _ in cases)
    if bert and not os.path.isfile(a.bert_vocab_file):
        raise SystemExit(f"--bert-vocab-file {a.bert_vocab_file}: no such file (the ours-bert cases need it)")
    data_prefix = (prepare_dataset(workdir), prepare_bert_dataset(workdir, a.bert_vocab_file) if bert else None,
                   a.bert_vocab_file)
    runs = []
    for shape, trainer, flags in cases:
        for r in range(a.rounds):
            for name, path in trees:
                res = run_one(path, shape, trainer, flags, a.iters, a.warmup, data_prefix, workdir)
                runs.append({"case": f"{shape} {trainer} {flags}".strip(), "round": r + 1, "tree": name, **res})
                shown = f"{res['ms_per_iter']:.2f} ms, MFU {100 * res['mfu']:.1f}%" if "error" not in res \
                    else "FAILED " + res["error"][-300:]
                print(f"{runs[-1]['case']} | round {r + 1} | {name}: {shown}", flush=True)
    body = ["| case | tree | ms/iter (each round) | median ms/iter | MFU, bf16 peak (median) | tokens/s vs "
            f"{trees[0][0]} |", "|---|---|---|---|---|---|"]
    for shape, trainer, flags in cases:
        case = f"{shape} {trainer} {flags}".strip()
        medians = {}
        for name, _ in trees:
            mine = [x["ms_per_iter"] for x in runs if x["case"] == case and x["tree"] == name and "error" not in x]
            medians[name] = statistics.median(mine) if mine else None
        base = medians[trees[0][0]]
        for name, _ in trees:
            mine = [x for x in runs if x["case"] == case and x["tree"] == name and "error" not in x]
            if not mine:
                body.append(f"| {case} | {name} | failed | | | |")
                continue
            ms = medians[name]
            ratio = f"{base / ms:.3f}x" if base else "n/a"
            each = ", ".join(f"{x['ms_per_iter']:.2f}" for x in mine)
            body.append(f"| {case} | {name} | {each} | {ms:.2f} | "
                        f"{100 * statistics.median(x['mfu'] for x in mine):.1f}% | {ratio} |")
    body += ["", "Trees: " + ", ".join(f"{n} = `{p}`" for n, p in trees) + "."]
    write_results(a.results_dir, f"ab_{a.tag}", meta, runs, "A/B of source trees", body)
    print("\n".join(body))


if __name__ == "__main__":
    main()
