#!/usr/bin/env python
"""Merge several .bin/.idx datasets into one (documents and their boundaries kept, in order).

    python tools/merge_datasets.py --input DIR --output-prefix OUT
merges every PREFIX.bin/PREFIX.idx pair found in DIR (sorted by name), as Megatron-LM's tool does;
    python tools/merge_datasets.py --input P1 P2 ... --output-prefix OUT
merges the given prefixes in the given order. All inputs must share one token dtype.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    IndexReader,
    dataset_exists,
)


def find_prefixes(inputs):
    """Prefixes to merge: every complete pair in a directory (sorted), or the prefixes given."""
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            names = sorted(f[:-4] for f in os.listdir(item) if f.endswith(".idx"))
            found = [os.path.join(item, n) for n in names if dataset_exists(os.path.join(item, n))]
            missing = [n for n in names if not dataset_exists(os.path.join(item, n))]
            if missing:
                raise ValueError(f"--input {item}: {missing[0]}.idx has no matching .bin")
            prefixes.extend(found)
        else:
            p = item[:-4] if item.endswith((".bin", ".idx")) else item
            if not dataset_exists(p):
                raise ValueError(f"--input {item}: expected {p}.bin and {p}.idx")
            prefixes.append(p)
    if not prefixes:
        raise ValueError(f"--input {inputs}: no .bin/.idx pair found")
    return prefixes


def merge(prefixes, output_prefix):
    """Write OUTPUT_PREFIX.bin/.idx holding every dataset of ``prefixes`` in order."""
    out_abs = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out_abs for p in prefixes):
        raise ValueError(f"--output-prefix {output_prefix} is also an input")
    dtypes = {p: IndexReader(p + ".idx").dtype for p in prefixes}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"inputs have different token dtypes: { {p: str(d) for p, d in dtypes.items()} }")
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtypes[prefixes[0]])
    try:
        for p in prefixes:
            builder.add_index(p)
        builder.finalize(output_prefix + ".idx")
    except BaseException:
        builder.abort()
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="a directory of datasets, or dataset prefixes")
    p.add_argument("--output-prefix", required=True, help="output path without .bin/.idx")
    a = p.parse_args(argv)
    try:
        prefixes = find_prefixes(a.input)
        merge(prefixes, a.output_prefix)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {a.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
