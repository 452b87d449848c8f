"""What the reliability checks cost: checkpoint hashing, durable saves, verification, the start-up data check.

    python bench/reliability_costs.py --prefix /tmp/rel_data/prose_text_document [--mb 100] [--repeats 3]
        [--dir /tmp/reliability_bench] [--results bench/results/reliability_costs]

``--prefix`` is a ``.bin``/``.idx`` pair, e.g. the 25.8 MB corpus preprocessed with

    python tools/preprocess_data.py --input ../shared/data/corpus/prose.jsonl.gz --output-prefix /tmp/rel_data/prose \
        --tokenizer-type GPT2BPETokenizer --vocab-file ../shared/data/gpt2/vocab.json \
        --merge-file ../shared/data/gpt2/merges.txt --append-eod --workers 1

Measured (best of ``--repeats``, the file in the page cache; the machine may be shared, ``uptime`` is recorded):
hashlib's SHA-256, BLAKE2b, SHA-1 and MD5 over a ``--mb`` MB file; ``torch.save`` of a ``--mb`` MB state dict to
a path next to ``checkpoint_io.save_torch`` (SHA-256 while writing, fsync of file and folder, rename);
``verify_checkpoint`` of that file; ``check_token_ids`` (and the ``IndexedDataset`` open) of ``--prefix``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.results_io import run_meta, write_results  # noqa: E402
from megatron.core.datasets.checks import check_token_ids, sentence_level_warning  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core import checkpoint_io as cio  # noqa: E402


def best_of(repeats, fn):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prefix", required=True)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/reliability_bench")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "reliability_costs"))
    a = p.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.dir, exist_ok=True)
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = []

    nbytes = a.mb * 2**20
    blob = os.path.join(a.dir, "blob.bin")
    with open(blob, "wb") as f:
        f.write(os.urandom(nbytes))
    for algo in ("sha256", "blake2b", "sha1", "md5"):
        t = best_of(a.repeats, lambda: cio.file_digest(blob, algo))
        rows.append({"what": f"{algo} of a {a.mb} MB file", "seconds": t, "MB/s": a.mb / t})

    state = {"model": {"w": torch.randn(nbytes // 4)}}  # fp32: a.mb MB of tensor data
    plain = os.path.join(a.dir, "plain.pt")
    t_plain = best_of(a.repeats, lambda: torch.save(state, plain))
    rows.append({"what": f"torch.save of {a.mb} MB to a path (no fsync, no hash)", "seconds": t_plain,
                 "MB/s": a.mb / t_plain})
    folder = os.path.join(a.dir, "iter_0000001")
    records = []
    t_safe = best_of(a.repeats, lambda: records.append(cio.save_torch(state, folder, "mp_rank_00/m.pt")))
    rows.append({"what": f"checkpoint_io.save_torch of {a.mb} MB (sha256 while writing, fsync, rename)",
                 "seconds": t_safe, "MB/s": a.mb / t_safe})
    cio.write_manifest(folder, 1, records[-1:])
    t_verify = best_of(a.repeats, lambda: cio.verify_checkpoint(folder, 1))
    rows.append({"what": f"verify_checkpoint of the {a.mb} MB file", "seconds": t_verify, "MB/s": a.mb / t_verify})

    bin_mb = os.path.getsize(a.prefix + ".bin") / 2**20
    t_open = best_of(a.repeats, lambda: IndexedDataset(a.prefix))
    t_check = best_of(a.repeats, lambda: check_token_ids(IndexedDataset(a.prefix), a.vocab_size))
    found = check_token_ids(a.prefix, a.vocab_size)
    rows.append({"what": f"IndexedDataset open of {os.path.basename(a.prefix)}", "seconds": t_open})
    rows.append({"what": f"open + check_token_ids ({bin_mb:.1f} MB .bin, {found.num_tokens:,} tokens, "
                         f"max id {found.max_id})", "seconds": t_check, "MB/s": bin_mb / t_check})
    rows.append({"what": "sentence_level_warning", "seconds": best_of(a.repeats, lambda: sentence_level_warning(
        a.prefix))})
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    shutil.rmtree(a.dir, ignore_errors=True)

    table = ["| measurement | seconds | MB/s |", "|---|---|---|"]
    for r in rows:
        rate = f"{r['MB/s']:.0f}" if "MB/s" in r else ""
        table.append(f"| {r['what']} | {r['seconds']:.4f} | {rate} |")
    body = [f"CPU: {os.cpu_count()} cores; load before: `{load_before}`; after: `{load_after}`", "", *table]
    print("\n".join(body))
    meta = run_meta("reliability_costs.py")
    write_results(os.path.dirname(a.results), os.path.basename(a.results), meta, rows,
                  "Reliability checks: cost of hashing, durable saves and the start-up data check", body)


if __name__ == "__main__":
    main()
