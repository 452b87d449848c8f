"""Generate megatron_core_golden.json with Megatron-Core (NOT a project dependency).

Run from the repository root with a throw-away environment holding megatron-core:

    python -m venv /tmp/mcore
    /tmp/mcore/bin/pip install megatron-core==0.16.1 numpy torch==2.13.0
    /tmp/mcore/bin/python tests/unit/data/golden/make_golden.py

It writes small .bin/.idx files with Megatron-Core's IndexedDatasetBuilder from a fixed token list
(sha256 of the files), builds GPT datasets and blends with Megatron-Core's BlendedMegatronDatasetBuilder
on them, and records every sample (as sha256 of the int64 tokens of all items in order, plus the first
items in full) and the blending indices of a larger weighted blend.
"""

import hashlib
import json
import os
import sys
import tempfile

import numpy
from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from golden_spec import CONFIGS, SHOW, blend_case, synthetic_documents  # noqa: E402


class _Tok:
    eod = 50256
    pad = 50256
    vocab_size = 50257
    unique_identifiers = {"class": "SyntheticTokenizer"}


def sha(a):
    return hashlib.sha256(numpy.ascontiguousarray(a).tobytes()).hexdigest()


def file_sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_dataset(prefix, name, dtype):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in synthetic_documents(name):
        for seq in doc:
            b.add_item(_Tensor(seq))
        b.end_document()
    b.finalize(prefix + ".idx")


class _Tensor:
    def __init__(self, a):
        self.a = numpy.asarray(a, dtype=numpy.int64)

    def numpy(self):
        return self.a


def item_text(ds, i):
    if hasattr(ds, "dataset_index"):
        d = int(ds.dataset_index[i])
        return item_text(ds.datasets[d], int(ds.dataset_sample_index[i]))
    return ds._query_document_sample_shuffle_indices(i)[0].astype(numpy.int64)


def main():
    import torch

    # Megatron-Core's BlendedDataset asks for the rank: run as a one-process group.
    torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), world_size=1, rank=0)
    out = {"megatron_core_version": "0.16.1", "files": {}, "configs": {}}
    tmp = tempfile.mkdtemp()
    prefixes = {}
    for name, dtype in (("A", numpy.uint16), ("B", numpy.uint16), ("W", numpy.int32)):
        p = os.path.join(tmp, name)
        write_dataset(p, name, dtype)
        prefixes[name] = p
        out["files"][name] = {"bin_sha256": file_sha(p + ".bin"), "idx_sha256": file_sha(p + ".idx")}
    for cname, c in CONFIGS.items():
        blend_list = [prefixes[x] if x in prefixes else x for x in c["data_path"]]
        if len(blend_list) == 1:
            blend = (blend_list, None)
        elif all(x in prefixes.values() for x in blend_list):
            blend = (blend_list, None)
        else:
            blend = (blend_list[1::2], [float(w) for w in blend_list[0::2]])
        cfg = GPTDatasetConfig(
            random_seed=c["seed"], sequence_length=c["seq_length"], blend=blend, split=c["split"],
            path_to_cache=os.path.join(tmp, "cache"), tokenizer=_Tok(), reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, mmap_bin_files=True,
        )
        sizes = list(c["sizes"])
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
        res = {}
        for split, ds in zip(("train", "valid", "test"), datasets):
            if ds is None or sizes[["train", "valid", "test"].index(split)] == 0:
                res[split] = None
                continue
            texts = [item_text(ds, i) for i in range(len(ds))]
            res[split] = {
                "len": len(ds),
                "all_sha256": sha(numpy.concatenate(texts)) if texts else None,
                "first": [t.tolist() for t in texts[:SHOW]],
            }
        out["configs"][cname] = res
    weights, size = blend_case()
    di = numpy.zeros(size, dtype=numpy.int16)
    dsi = numpy.zeros(size, dtype=numpy.int64)
    helpers.build_blending_indices(di, dsi, numpy.array(weights, dtype=numpy.float64), len(weights), size, False)
    out["blending"] = {"dataset_index_sha256": sha(di), "dataset_sample_index_sha256": sha(dsi),
                       "counts": numpy.bincount(di).tolist()}
    sizes = [37, 1, 250, 12]
    di = numpy.zeros(sum(sizes), dtype=numpy.int16)
    dsi = numpy.zeros(sum(sizes), dtype=numpy.int64)
    helpers.build_exhaustive_blending_indices(di, dsi, numpy.array(sizes, dtype=numpy.int64), len(sizes))
    out["exhaustive_blending"] = {"sizes": sizes, "dataset_index": di.tolist(), "dataset_sample_index": dsi.tolist()}
    with open(os.path.join(HERE, "megatron_core_golden.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", os.path.join(HERE, "megatron_core_golden.json"))


if __name__ == "__main__":
    main()
