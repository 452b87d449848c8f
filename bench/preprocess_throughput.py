"""Preprocessing throughput: MB/s of loose JSON turned into .bin/.idx, ours next to Megatron-LM's procedure.

    python bench/preprocess_throughput.py [--repeats 3] [--baseline] [--workers 2]

Gunzips ../shared/data/corpus/prose.jsonl.gz (25.8 MB, 15,353 documents) to /tmp, runs

    python tools/preprocess_data.py --input /tmp/prose.jsonl --output-prefix /tmp/bench_prose \
        --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt \
        --append-eod --workers 2

``--repeats`` times as a separate process (wall time includes start-up), checks the files are byte-identical
to Megatron-LM's (sha256 in tests/unit/data/golden/preprocess_golden.json), and with ``--baseline`` also
times Megatron-LM's procedure on the same machine at the same moment: ``multiprocessing.Pool(2).imap(encode,
lines, 32)`` with a pure-Python GPT-2 BPE per document (the algorithm of Megatron-LM's GPT2Tokenizer, from
tests/unit/data/reference_bpe.py), which is what makes Megatron-LM slow. The machine is shared, so the load
average is recorded and the ratio to the baseline measured in the same run is the fairest number.
Writes bench/results/preprocess.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
MEGATRON_QUOTED_MBS = 3.2  # ../shared/data/README.md: Megatron-LM on a 2-core machine


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _siblings(cpu: int) -> set:
    """Logical CPUs sharing a physical core with ``cpu`` (hyper-threads), from sysfs."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            out = set()
            for part in f.read().strip().split(","):
                lo, _, hi = part.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
            return out
    except OSError:
        return {cpu}


def _two_cores() -> set:
    """Two logical CPUs on two different physical cores (a fair '2-core machine')."""
    avail = sorted(os.sched_getaffinity(0))
    first = avail[0]
    second = next((c for c in avail if c not in _siblings(first)), avail[1])
    return {first, second}


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# ---- Megatron-LM's procedure (baseline) ------------------------------------------------------------

_BPE = None


def _baseline_init():
    global _BPE
    from tests.unit.data.reference_bpe import ReferenceGPT2BPE

    _BPE = ReferenceGPT2BPE(os.path.join(ROOT, "data", "gpt2-vocab.json"), os.path.join(ROOT, "data", "gpt2-merges.txt"))


def _baseline_encode(line: str):
    ids = _BPE.encode(json.loads(line)["text"])
    if ids:
        ids.append(50256)
    return ids, len(line)


def run_baseline(src: str, prefix: str, workers: int) -> float:
    """Seconds for Megatron-LM's structure: Pool.imap(encode, file, 32) + add_document per result."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    import numpy as np

    t0 = time.time()
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    with open(src, encoding="utf-8") as fin, multiprocessing.Pool(workers, initializer=_baseline_init) as pool:
        for ids, _ in pool.imap(_baseline_encode, fin, 32):
            builder.add_document(ids, [len(ids)] if ids else [])
    builder.finalize(prefix + ".idx")
    return time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--baseline", action="store_true", help="also time Megatron-LM's procedure (slow)")
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "preprocess"))
    ap.add_argument("--input-gz", default=os.path.join(SHARED, "corpus", "prose.jsonl.gz"))
    ap.add_argument("--large", type=int, default=0, metavar="K",
                    help="also time one run on the input repeated K times (an upper bound for large corpora: "
                         "after the first copy every piece is in the tokenizer's cache)")
    ap.add_argument("--cpus", default=None,
                    help="pin every process to these CPUs (e.g. 0,1), or 'two-cores': two CPUs on distinct cores")
    a = ap.parse_args()

    src = "/tmp/prose.jsonl"
    if not os.path.exists(src):
        with gzip.open(a.input_gz, "rb") as f, open(src + ".part", "wb") as g:
            shutil.copyfileobj(f, g)
        os.replace(src + ".part", src)
    mb = os.path.getsize(src) / 1e6
    golden = json.load(open(os.path.join(ROOT, "tests", "unit", "data", "golden", "preprocess_golden.json")))["full"]

    cmd = [sys.executable, "tools/preprocess_data.py", "--input", src, "--output-prefix", "/tmp/bench_prose",
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "data/gpt2-vocab.json",
           "--merge-file", "data/gpt2-merges.txt", "--append-eod", "--workers", str(a.workers),
           "--log-interval", "100000"]
    if a.cpus:
        cpus = _two_cores() if a.cpus == "two-cores" else {int(c) for c in a.cpus.split(",")}
        os.sched_setaffinity(0, cpus)  # inherited by every child process
    load_before = _load()
    walls = []
    for _ in range(a.repeats):
        t0 = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        walls.append(time.time() - t0)
        print(f"ours: {walls[-1]:.2f} s = {mb / walls[-1]:.2f} MB/s (load {_load()})", flush=True)
    identical = (_sha("/tmp/bench_prose_text_document.bin") == golden["bin_sha256"]
                 and _sha("/tmp/bench_prose_text_document.idx") == golden["idx_sha256"])
    large = None
    if a.large > 1:
        big = f"/tmp/prose_x{a.large}.jsonl"
        if not os.path.exists(big):
            with open(src, "rb") as f:
                data = f.read()
            with open(big + ".part", "wb") as g:
                for _ in range(a.large):
                    g.write(data)
            os.replace(big + ".part", big)
        big_cmd = list(cmd)
        big_cmd[big_cmd.index("--input") + 1] = big
        big_cmd[big_cmd.index("--output-prefix") + 1] = "/tmp/bench_large"
        t0 = time.time()
        subprocess.run(big_cmd, cwd=ROOT, check=True, capture_output=True)
        large = {"copies": a.large, "mb": round(a.large * mb, 2), "seconds": round(time.time() - t0, 2)}
        large["mbs"] = round(large["mb"] / large["seconds"], 2)
        print(f"ours on {a.large} copies: {large['seconds']} s = {large['mbs']} MB/s", flush=True)
    baseline = None
    if a.baseline:
        baseline = run_baseline(src, "/tmp/bench_baseline", a.workers)
        print(f"Megatron-LM procedure: {baseline:.2f} s = {mb / baseline:.2f} MB/s (load {_load()})", flush=True)
        identical = identical and _sha("/tmp/bench_baseline.bin") == golden["bin_sha256"]
    best, median = min(walls), sorted(walls)[len(walls) // 2]
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {len(os.sched_getaffinity(0))} of {os.cpu_count()} logical CPUs used "
                   f"({sorted(os.sched_getaffinity(0))}; hyper-thread siblings of each: "
                   f"{[sorted(_siblings(c)) for c in sorted(os.sched_getaffinity(0))]}), "
                   f"Python {platform.python_version()}",
        "load_average_before": load_before, "load_average_after": _load(),
        "command": " ".join(["python"] + cmd[1:]), "input_mb": round(mb, 2), "workers": a.workers,
        "wall_seconds": [round(w, 2) for w in walls],
        "ours_mbs_best": round(mb / best, 2), "ours_mbs_median": round(mb / median, 2),
        "baseline_seconds": None if baseline is None else round(baseline, 2),
        "baseline_mbs": None if baseline is None else round(mb / baseline, 2),
        "megatron_quoted_mbs": MEGATRON_QUOTED_MBS,
        "byte_identical_to_megatron": identical,
        "large_repeated_input": large,
    }
    os.makedirs(os.path.dirname(a.results), exist_ok=True)
    with open(a.results + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(a.results + ".md", "w") as f:
        f.write(_markdown(res))
    print(json.dumps(res, indent=1))
    return 0


def _markdown(r: dict) -> str:
    lines = [
        "# Preprocessing throughput",
        "",
        f"- date: {r['date']}",
        f"- machine: {r['machine']}; load average {r['load_average_before']} before, "
        f"{r['load_average_after']} after (the machine is shared with other jobs)",
        f"- input: prose.jsonl ({r['input_mb']} MB of loose JSON, 15,353 documents), GPT2BPETokenizer, "
        f"--append-eod, {r['workers']} workers",
        f"- command: `{r['command']}`",
        f"- output byte-identical to Megatron-LM's: {r['byte_identical_to_megatron']}",
        "",
        "| pipeline | MB/s of JSON | ratio |",
        "|---|---|---|",
        f"| ours, median of {len(r['wall_seconds'])} runs (wall time incl. start-up: {r['wall_seconds']} s) | "
        f"{r['ours_mbs_median']} | {r['ours_mbs_median'] / r['megatron_quoted_mbs']:.1f}x the quoted figure |",
        f"| ours, best run | {r['ours_mbs_best']} | {r['ours_mbs_best'] / r['megatron_quoted_mbs']:.1f}x |",
        f"| Megatron-LM, quoted in ../shared/data/README.md | {r['megatron_quoted_mbs']} | 1.0x |",
    ]
    if r["baseline_mbs"]:
        lines.append(f"| Megatron-LM's procedure measured in the same run (pure-Python BPE, Pool.imap) | "
                     f"{r['baseline_mbs']} | ours is {r['ours_mbs_median'] / r['baseline_mbs']:.1f}x (median) |")
    if r.get("large_repeated_input"):
        g = r["large_repeated_input"]
        lines.append(f"| ours on prose.jsonl repeated {g['copies']} times ({g['mb']} MB; copies 2.. hit the piece "
                     f"cache: an upper bound for large corpora) | {g['mbs']} | "
                     f"{g['mbs'] / r['megatron_quoted_mbs']:.1f}x the quoted figure |")
    lines += ["", "Reproduce: `python bench/preprocess_throughput.py --baseline --large 4`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
