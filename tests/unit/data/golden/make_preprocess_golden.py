"""Record the files Megatron-LM's preprocess_data.py writes for prose.jsonl (GPT2BPETokenizer, --append-eod).

Megatron-LM's tool is not in the megatron-core wheel, so this restates its per-document procedure
(json.loads each line, GPT-2 BPE of the text, append EOD when the document has tokens, then
``IndexedDatasetBuilder.add_document(ids, [len])``) on top of Megatron-Core's own IndexedDatasetBuilder and
the independent pure-Python GPT-2 BPE of tests/unit/data/reference_bpe.py. Run from the repository root:

    /tmp/mcore/bin/pip install megatron-core==0.16.1 numpy torch==2.13.0 regex
    /tmp/mcore/bin/python tests/unit/data/golden/make_preprocess_golden.py

It writes preprocess_golden.json: sha256 and sizes of the .bin/.idx for the first 1,500 lines of
prose.jsonl and for the whole file.
"""

import gzip
import hashlib
import json
import os
import sys
import tempfile

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
sys.path.insert(0, os.path.dirname(HERE))
from reference_bpe import ReferenceGPT2BPE  # noqa: E402  (pure Python: json and regex only)

FIRST_LINES = 1500


def file_sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run(lines, prefix, bpe):
    eod = bpe.encoder["<|endoftext|>"]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(len(bpe.encoder)))
    for line in lines:
        text = json.loads(line)["text"]
        ids = bpe.encode(text)
        lens = [len(ids)] if ids else []
        if ids:
            ids.append(eod)
            lens[-1] += 1
        builder.add_document(ids, lens)
    builder.finalize(prefix + ".idx")
    return {"bin_sha256": file_sha(prefix + ".bin"), "idx_sha256": file_sha(prefix + ".idx"),
            "bin_bytes": os.path.getsize(prefix + ".bin"), "idx_bytes": os.path.getsize(prefix + ".idx")}


def main():
    bpe = ReferenceGPT2BPE(os.path.join(SHARED, "gpt2", "vocab.json"), os.path.join(SHARED, "gpt2", "merges.txt"))
    with gzip.open(os.path.join(SHARED, "corpus", "prose.jsonl.gz"), "rt", encoding="utf-8") as f:
        lines = f.readlines()
    tmp = tempfile.mkdtemp()
    out = {"source": "prose.jsonl (gunzipped ../shared/data/corpus/prose.jsonl.gz)",
           "first_lines": FIRST_LINES,
           "first": run(lines[:FIRST_LINES], os.path.join(tmp, "first"), bpe),
           "full": run(lines, os.path.join(tmp, "full"), bpe)}
    with open(os.path.join(HERE, "preprocess_golden.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
