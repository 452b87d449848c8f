#!/usr/bin/env python
"""Show what a training run will see: build the train/valid/test splits as training does and print them.

    python tools/inspect_dataset.py --data-path runs/data/quickstart_text_document --split 949,50,1 \\
        --seq-length 256 --seed 1234 --num-samples 1000 100 10 --show 2

prints each split's number of samples and its first K samples as decoded text (GPT-2 tokenizer from the
bundled data/ files unless --tokenizer-type/--vocab-file/--merge-file/--tokenizer-model say otherwise).
With --json it prints one JSON object instead:
    {"train": {"len": n, "samples": [[ids...], ...]}, "valid": {...}, "test": {...}}
with seq_length + 1 ids per sample (a split that is not built has len 0 and no samples).
--data-path takes Megatron's forms: PREFIX, P1 P2 ..., or W1 P1 W2 P2 ...
"""

import argparse
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

from megatron.core.datasets import build_gpt_datasets  # noqa: E402


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", nargs="+", required=True)
    p.add_argument("--split", default="949,50,1")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-samples", type=int, nargs=3, required=True, metavar=("TRAIN", "VALID", "TEST"))
    p.add_argument("--show", type=int, default=3, help="samples to print per split")
    p.add_argument("--json", action="store_true", help="print JSON (token ids) instead of text")
    p.add_argument("--data-cache-path", default=None, help="where index .npy files are cached (default: none)")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    p.add_argument("--vocab-file", default=os.path.join(ROOT, "data", "gpt2-vocab.json"))
    p.add_argument("--merge-file", default=os.path.join(ROOT, "data", "gpt2-merges.txt"))
    p.add_argument("--tokenizer-model", default=None)
    a = p.parse_args(argv)
    if a.seq_length < 1:
        p.error(f"--seq-length must be >= 1, got {a.seq_length}")
    if a.show < 0:
        p.error(f"--show must be >= 0, got {a.show}")
    return a


def main(argv=None) -> int:
    a = get_args(argv)
    try:
        splits = build_gpt_datasets(a.data_path, a.split, a.seq_length, a.seed, a.num_samples,
                                    cache_dir=a.data_cache_path)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    names = ("train", "valid", "test")
    report = {}
    for name, ds in zip(names, splits):
        n = 0 if ds is None else len(ds)
        samples = [] if ds is None else [ds[i]["text"].tolist() for i in range(min(a.show, n))]
        report[name] = {"len": n, "samples": samples}
    if a.json:
        print(json.dumps(report))
        return 0
    from megatron.core.tokenizer import build_tokenizer

    tok = build_tokenizer(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model)
    for name in names:
        r = report[name]
        print(f"=== {name}: {r['len']} samples of {a.seq_length + 1} tokens")
        for i, ids in enumerate(r["samples"]):
            print(f"--- {name}[{i}]")
            print(tok.detokenize(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
