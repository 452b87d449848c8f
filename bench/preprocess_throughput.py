"""Preprocessing throughput: MB/s of loose JSON turned into .bin/.idx, ours next to Megatron-LM's procedure.

    python bench/preprocess_throughput.py [--repeats 5] [--baseline] [--workers 2] [--cpus two-cores]
        [--compare-no-tiktoken] [--large 4] [--results PREFIX]

Gunzips ../shared/data/corpus/prose.jsonl.gz (25.8 MB, 15,353 documents; ``--input-gz`` elsewhere) to /tmp, runs

    python tools/preprocess_data.py --input /tmp/prose.jsonl --output-prefix /tmp/bench_prose \
        --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt \
        --append-eod --workers 2

``--repeats`` times as a separate process (wall time includes start-up and exit), checks after every run that
the files are byte-identical to Megatron-LM's (sha256 in tests/unit/data/golden/preprocess_golden.json), and
with ``--baseline`` also times Megatron-LM's procedure on the same CPUs in the same run:
``multiprocessing.Pool(2).imap(encode, lines, 32)`` with a pure-Python GPT-2 BPE per document (the algorithm of
Megatron-LM's GPT2Tokenizer, from tests/unit/data/reference_bpe.py), which is what makes Megatron-LM slow.
``--compare-no-tiktoken`` also times our command with ``MEGATRON_NO_TIKTOKEN=1`` (new pieces BPE-encoded by
the Hugging Face model: the path taken where tiktoken is not installed). The start-up cost (a one-document
input) is measured too. The machine may be shared, so ``uptime`` is recorded before and after, and the
ratio to the baseline measured in the same run is the fairest number. Writes PREFIX.md and PREFIX.json.
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
import tempfile
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


def profile_stages(src: str, workers: int) -> dict:
    """CPU seconds per stage of one worker's share of ``src`` (every ``workers``-th byte range, as when the
    workers keep pace), run in this process the way a worker runs it, plus the parent's start-up, the
    transfer of the results (pickling, as the pool does) and the writing of the .bin/.idx."""
    import pickle

    import numpy as np

    from megatron.core.datasets import preprocessing as P
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.tokenizer import build_tokenizer

    pt = time.process_time
    res = {}
    cfg = P.PreprocessConfig(input=src, output_prefix="/tmp/bench_profile", tokenizer_type="GPT2BPETokenizer",
                             vocab_file=os.path.join(ROOT, "data", "gpt2-vocab.json"),
                             merge_file=os.path.join(ROOT, "data", "gpt2-merges.txt"), append_eod=True,
                             workers=workers, quiet=True)
    t = pt()
    tok = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file)
    res["parent start-up: tokenizer (vocab.json)"] = pt() - t
    t = pt()
    P._init_worker(cfg, tok)
    P._warm_up(tok)
    res["parent start-up: bulk encoder (cached tables, tiktoken)"] = pt() - t
    stages = {"read lines": 0.0, "parse JSON, check values": 0.0, "EOD, lengths, dtype": 0.0}
    real = {name: getattr(P, name) for name in ("_read_lines", "_parse", "_assemble")}

    def timed(name, stage):
        def f(*a, **k):
            t0 = pt()
            try:
                return real[name](*a, **k)
            finally:
                stages[stage] += pt() - t0
        return f

    def read_lines(*a):
        it = real["_read_lines"](*a)
        while True:
            t0 = pt()
            try:
                lines = next(it)
            except StopIteration:
                return
            finally:
                stages["read lines"] += pt() - t0
            yield lines

    P._parse, P._assemble, P._read_lines = timed("_parse", "parse JSON, check values"), \
        timed("_assemble", "EOD, lengths, dtype"), read_lines
    tok._fast.timings = {}
    share = P._line_ranges(src, workers)[::workers]
    results, t = [], pt()
    try:
        for r in share:
            results.append(P.encode_range(r))
    finally:
        P._parse, P._assemble, P._read_lines = real["_parse"], real["_assemble"], real["_read_lines"]
    total = pt() - t
    fast = dict(tok._fast.timings)
    tok._fast.timings = None
    new_pieces = int(fast.pop("new pieces", 0))
    res.update({f"worker: {k}": v for k, v in stages.items()})
    res.update({f"worker: tokenise: {k}": v for k, v in fast.items()})
    res["worker: other (per-document checks, batching)"] = total - sum(stages.values()) - sum(fast.values())
    res["worker: total for its share"] = total
    t = pt()
    blobs = [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in results]
    back = [pickle.loads(b) for b in blobs]
    res["transfer: pickle + unpickle the results"] = pt() - t
    t = pt()
    builder = IndexedDatasetBuilder("/tmp/bench_profile.bin", np.uint16)
    for out in back:
        builder.add_documents(*out[0]["text"])
    builder.finalize("/tmp/bench_profile.idx")
    res["parent: write .bin/.idx (this share)"] = pt() - t
    res = {k: round(v, 4) for k, v in res.items()}
    res["new pieces BPE-encoded by this worker"] = new_pieces
    res["share of the input, MB"] = round(sum(b - a for _, a, b in share) / 1e6, 2)
    res["result bytes transferred"] = sum(map(len, blobs))
    return res


_CPU: dict = {}  # label -> CPU seconds (user + system, all processes) of each timed run


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _self_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"load average {_load()}"


def _time_runs(cmd, n: int, env=None, check_files=None, label="ours") -> list:
    """Wall seconds of ``n`` runs of ``cmd``; with ``check_files`` ((bin, idx) paths, golden) every run's
    output is compared with Megatron-LM's."""
    walls = []
    for _ in range(n):
        c0 = _children_cpu()
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
        walls.append(time.perf_counter() - t0)
        _CPU.setdefault(label, []).append(round(_children_cpu() - c0, 3))
        ok = ""
        if check_files is not None:
            (b, i), golden = check_files
            same = _sha(b) == golden["bin_sha256"] and _sha(i) == golden["idx_sha256"]
            if not same:
                raise SystemExit(f"{label}: output differs from Megatron-LM's (sha256 of {b} / {i})")
            ok = ", byte-identical"
        print(f"{label}: {walls[-1]:.3f} s, CPU {_CPU[label][-1]:.2f} s{ok} (load {_load()})", flush=True)
    return walls


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--baseline", action="store_true", help="also time Megatron-LM's procedure (slow)")
    ap.add_argument("--baseline-repeats", type=int, default=1)
    ap.add_argument("--compare-no-tiktoken", action="store_true",
                    help="also time our command with MEGATRON_NO_TIKTOKEN=1 (the Hugging Face BPE for new pieces)")
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "preprocess"),
                    help="write PREFIX.md and PREFIX.json")
    ap.add_argument("--input-gz", default=os.path.join(SHARED, "corpus", "prose.jsonl.gz"))
    ap.add_argument("--large", type=int, default=0, metavar="K",
                    help="also time one run on the input repeated K times (a bound for large corpora, where "
                         "the share of pieces never seen before falls)")
    ap.add_argument("--profile", action="store_true",
                    help="also measure the CPU time of every stage for one worker's share (in this process)")
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
    outputs = (("/tmp/bench_prose_text_document.bin", "/tmp/bench_prose_text_document.idx"), golden)

    cmd = [sys.executable, "tools/preprocess_data.py", "--input", src, "--output-prefix", "/tmp/bench_prose",
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "data/gpt2-vocab.json",
           "--merge-file", "data/gpt2-merges.txt", "--append-eod", "--workers", str(a.workers),
           "--log-interval", "100000"]
    if a.cpus:
        cpus = _two_cores() if a.cpus == "two-cores" else {int(c) for c in a.cpus.split(",")}
        os.sched_setaffinity(0, cpus)  # inherited by every child process
    try:
        import tiktoken

        tiktoken_version = tiktoken.__version__
    except ImportError:
        tiktoken_version = None
    uptime_before = _uptime()
    print(uptime_before, flush=True)

    one = "/tmp/bench_one.jsonl"
    with open(one, "w") as f:
        f.write('{"text": "One short document."}\n')
    startup_cmd = list(cmd)
    startup_cmd[startup_cmd.index("--input") + 1] = one
    startup_cmd[startup_cmd.index("--output-prefix") + 1] = "/tmp/bench_one"
    startup = _time_runs(startup_cmd, 3, label="start-up (one document)")  # the first one fills the cache

    # The first run on a machine also builds the tokenizer-derived cache (megatron/core/tokenizer/gpt2_cache.py):
    # timed once with an empty cache folder; the start-up runs above and the repeats below use the cache.
    with tempfile.TemporaryDirectory() as empty:
        cold = _time_runs(cmd, 1, env=dict(os.environ, XDG_CACHE_HOME=empty), check_files=outputs,
                          label="ours, empty tokenizer cache")[0]
    walls = _time_runs(cmd, a.repeats, check_files=outputs)
    no_tk = None
    if a.compare_no_tiktoken:
        env = dict(os.environ, MEGATRON_NO_TIKTOKEN="1")
        no_tk = _time_runs(cmd, a.repeats, env=env, check_files=outputs, label="ours, MEGATRON_NO_TIKTOKEN=1")
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
        w = _time_runs(big_cmd, 1, label=f"ours on {a.large} copies")[0]
        large = {"copies": a.large, "mb": round(a.large * mb, 2), "seconds": round(w, 3),
                 "mbs": round(a.large * mb / w, 2)}
    baseline, bl = None, []
    if a.baseline:
        for _ in range(a.baseline_repeats):
            c0 = _children_cpu() + _self_cpu()
            bl.append(run_baseline(src, "/tmp/bench_baseline", a.workers))
            _CPU.setdefault("baseline", []).append(round(_children_cpu() + _self_cpu() - c0, 3))
            same = _sha("/tmp/bench_baseline.bin") == golden["bin_sha256"]
            print(f"Megatron-LM procedure: {bl[-1]:.2f} s = {mb / bl[-1]:.2f} MB/s, CPU {_CPU['baseline'][-1]:.1f} s, "
                  f".bin identical {same} "
                  f"(load {_load()})", flush=True)
        baseline = min(bl)  # the fastest run: the comparison most favourable to Megatron-LM
    profile = None
    if a.profile:
        profile = profile_stages(src, a.workers)
        for k, v in profile.items():
            print(f"profile: {k}: {v}", flush=True)
    uptime_after = _uptime()
    print(uptime_after, flush=True)
    med = _median(walls)
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {len(os.sched_getaffinity(0))} of {os.cpu_count()} logical CPUs used "
                   f"({sorted(os.sched_getaffinity(0))}; hyper-thread siblings of each: "
                   f"{[sorted(_siblings(c)) for c in sorted(os.sched_getaffinity(0))]}), "
                   f"Python {platform.python_version()}, tiktoken {tiktoken_version or 'not installed'}",
        "uptime_before": uptime_before, "uptime_after": uptime_after,
        "command": " ".join(["python"] + cmd[1:]), "input_mb": round(mb, 2), "workers": a.workers,
        "startup_seconds": [round(w, 3) for w in startup],
        "wall_seconds": [round(w, 3) for w in walls],
        "empty_cache_seconds": round(cold, 3), "empty_cache_mbs": round(mb / cold, 2),
        "ours_mbs_best": round(mb / min(walls), 2), "ours_mbs_median": round(mb / med, 2),
        "no_tiktoken_wall_seconds": None if no_tk is None else [round(w, 3) for w in no_tk],
        "no_tiktoken_mbs_median": None if no_tk is None else round(mb / _median(no_tk), 2),
        "baseline_seconds": None if baseline is None else round(baseline, 2),
        "baseline_seconds_all": None if baseline is None else [round(x, 2) for x in bl],
        "baseline_mbs": None if baseline is None else round(mb / baseline, 2),
        "ratio_median_to_baseline": None if baseline is None else round(baseline / med, 2),
        "megatron_quoted_mbs": MEGATRON_QUOTED_MBS,
        "byte_identical_to_megatron": True,  # checked after every run above (a difference stops the bench)
        "large_repeated_input": large,
        "profile_cpu_seconds": profile,
        "cpu_seconds_per_run": dict(_CPU),
    }
    if baseline is not None:
        res["cpu_ratio_baseline_to_ours"] = round(min(_CPU["baseline"]) / _median(_CPU["ours"]), 2)
    os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
    with open(a.results + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(a.results + ".md", "w") as f:
        f.write(_markdown(res))
    print(json.dumps(res, indent=1))
    return 0


def _markdown(r: dict) -> str:
    q = r["megatron_quoted_mbs"]
    lines = [
        "# Preprocessing throughput (one run of bench/preprocess_throughput.py)",
        "",
        f"- date: {r['date']}",
        f"- machine: {r['machine']}",
        f"- uptime before: `{r['uptime_before']}`; after: `{r['uptime_after']}`",
        f"- input: prose.jsonl ({r['input_mb']} MB of loose JSON, 15,353 documents), GPT2BPETokenizer, "
        f"--append-eod, {r['workers']} workers",
        f"- command: `{r['command']}`",
        "- every run's output byte-identical to Megatron-LM's (sha256 checked after each run): "
        f"{r['byte_identical_to_megatron']}",
        f"- start-up (the same command on a one-document input): {r['startup_seconds']} s",
        "",
        "| pipeline | MB/s of JSON | ratio |",
        "|---|---|---|",
        f"| ours, median of {len(r['wall_seconds'])} runs (wall incl. start-up and exit: {r['wall_seconds']} s) | "
        f"{r['ours_mbs_median']} | {r['ours_mbs_median'] / q:.1f}x the quoted {q} MB/s |",
        f"| ours, best run | {r['ours_mbs_best']} | {r['ours_mbs_best'] / q:.1f}x |",
        f"| ours, first run on the machine (empty tokenizer cache: {r['empty_cache_seconds']} s) | "
        f"{r['empty_cache_mbs']} | {r['empty_cache_mbs'] / q:.1f}x |",
    ]
    if r.get("no_tiktoken_mbs_median"):
        lines.append(f"| ours with MEGATRON_NO_TIKTOKEN=1, median ({r['no_tiktoken_wall_seconds']} s) | "
                     f"{r['no_tiktoken_mbs_median']} | {r['no_tiktoken_mbs_median'] / q:.1f}x |")
    if r["baseline_mbs"]:
        lines.append(f"| Megatron-LM's procedure, same CPUs, same run (fastest of {r['baseline_seconds_all']} s) | "
                     f"{r['baseline_mbs']} | ours is **{r['ratio_median_to_baseline']}x** (median) |")
    cpu = r.get("cpu_seconds_per_run") or {}
    if cpu.get("ours") and cpu.get("baseline"):
        lines.append(f"| CPU seconds (user + system, all processes): ours {cpu['ours']}, Megatron-LM's procedure "
                     f"{cpu['baseline']} | | Megatron-LM uses **{r['cpu_ratio_baseline_to_ours']}x** the CPU time |")
    if r.get("large_repeated_input"):
        g = r["large_repeated_input"]
        lines.append(f"| ours on prose.jsonl repeated {g['copies']} times ({g['mb']} MB, one run) | {g['mbs']} | "
                     f"{g['mbs'] / q:.1f}x |")
    if r.get("profile_cpu_seconds"):
        lines += ["", "CPU seconds per stage (`--profile`: one worker's share, run in one process, cache warm):", "",
                  "| stage | CPU s |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in r["profile_cpu_seconds"].items()]
    lines += ["", "Reproduce: `python bench/preprocess_throughput.py --baseline --compare-no-tiktoken --large 4 "
              "--profile --cpus two-cores --results PREFIX`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
