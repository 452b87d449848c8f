"""Our files, samples and blends equal Megatron-Core 0.16.1's (golden file made by golden/make_golden.py)."""

import hashlib
import json
import os
import sys

import numpy as np
import pytest

from megatron.core.datasets import IndexedDataset, IndexedDatasetBuilder, build_gpt_datasets
from megatron.core.datasets.blending import build_blending_indices, build_exhaustive_blending_indices

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
sys.path.insert(0, HERE)
from golden_spec import CONFIGS, SHOW, blend_case, synthetic_documents  # noqa: E402

with open(os.path.join(HERE, "megatron_core_golden.json")) as _f:
    GOLDEN = json.load(_f)


def _sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _file_sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    out = {}
    for name, dtype in (("A", np.uint16), ("B", np.uint16), ("W", np.int32)):
        p = str(root / name)
        b = IndexedDatasetBuilder(p + ".bin", dtype)
        for doc in synthetic_documents(name):
            for seq in doc:
                b.add_item(seq)
            b.end_document()
        b.finalize(p + ".idx")
        out[name] = p
    return out


def test_files_byte_identical_to_megatron_core_builder(prefixes):
    for name, p in prefixes.items():
        assert _file_sha(p + ".bin") == GOLDEN["files"][name]["bin_sha256"], name
        assert _file_sha(p + ".idx") == GOLDEN["files"][name]["idx_sha256"], name
        ds = IndexedDataset(p)
        seqs = [s for doc in synthetic_documents(name) for s in doc]
        assert len(ds) == len(seqs)
        assert all(np.array_equal(ds[i], seqs[i]) for i in range(len(seqs)))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_samples_equal_megatron_core(prefixes, config, tmp_path):
    c = CONFIGS[config]
    data_path = [prefixes.get(x, x) for x in c["data_path"]]
    datasets = build_gpt_datasets(data_path, c["split"], c["seq_length"], c["seed"], c["sizes"],
                                  cache_dir=str(tmp_path / "cache"))
    for split, ds in zip(("train", "valid", "test"), datasets):
        want = GOLDEN["configs"][config][split]
        if want is None:
            assert ds is None, split
            continue
        assert len(ds) == want["len"], split
        texts = [ds[i]["text"] for i in range(len(ds))]
        assert all(t.dtype == np.int64 and t.shape == (c["seq_length"] + 1,) for t in texts)
        assert [t.tolist() for t in texts[:SHOW]] == want["first"], split
        assert _sha(np.concatenate(texts)) == want["all_sha256"], split
    # a second build loads the cached indices and gives the same samples
    again = build_gpt_datasets(data_path, c["split"], c["seq_length"], c["seed"], c["sizes"],
                               cache_dir=str(tmp_path / "cache"))
    assert np.array_equal(again[0][len(again[0]) - 1]["text"], datasets[0][len(datasets[0]) - 1]["text"])


def test_blending_indices_equal_megatron_core():
    weights, size = blend_case()
    di, dsi = build_blending_indices(weights, size)
    assert _sha(di) == GOLDEN["blending"]["dataset_index_sha256"]
    assert _sha(dsi) == GOLDEN["blending"]["dataset_sample_index_sha256"]
    ex = GOLDEN["exhaustive_blending"]
    di, dsi = build_exhaustive_blending_indices(ex["sizes"])
    assert di.tolist() == ex["dataset_index"] and dsi.tolist() == ex["dataset_sample_index"]


def test_python_blending_loop_equals_c(monkeypatch):
    from megatron.core.datasets import blending

    weights = [0.5, 0.3, 0.2]
    c_result = blending.build_blending_indices(weights, 5000)
    c_ex = blending.build_exhaustive_blending_indices([5, 40, 7])
    monkeypatch.setattr(blending, "_load_c", lambda: None)
    py_result = blending.build_blending_indices(weights, 5000)
    py_ex = blending.build_exhaustive_blending_indices([5, 40, 7])
    assert all(np.array_equal(a, b) for a, b in zip(c_result, py_result))
    assert all(np.array_equal(a, b) for a, b in zip(c_ex, py_ex))
