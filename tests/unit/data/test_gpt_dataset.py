"""GPT dataset indices (epochs, last epoch, samples), blending proportions, sampler, rank-0 build + mmap."""

import os

import numpy as np
import pytest
import torch

from megatron.core.datasets import (
    IndexedDataset,
    IndexedDatasetBuilder,
    MegatronPretrainingSampler,
    build_gpt_datasets,
    build_pretraining_data_loader,
)
from megatron.core.datasets import gpt_dataset as G
from megatron.core.datasets.blending import build_blending_indices
from megatron.core.datasets.builder import parse_data_path, parse_split, split_bounds, split_documents
from tests.dist_utils import run_distributed


def _write(prefix, docs):
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for d in docs:
        b.add_item(d)
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def _docs(seed, n, max_len=60, allow_empty=False):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, 50000, size=int(rs.randint(0 if allow_empty else 1, max_len))) for _ in range(n)]


def _reference_sample_index(sizes, document_index, seq_length, num_samples):
    """Direct token-by-token walk: where does stream position k * seq_length fall?"""
    rows = [(0, 0)]
    owner = [(j, off) for j, d in enumerate(document_index) for off in range(sizes[d])]
    for k in range(1, num_samples + 1):
        rows.append(owner[k * seq_length])
    return np.array(rows)


@pytest.mark.parametrize("seq_length,num_samples", [(8, 10), (8, 200), (5, 333), (16, 57)])
def test_indices_against_direct_walk(seq_length, num_samples):
    docs = _docs(0, 40, allow_empty=True)
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    documents = np.arange(3, 37, dtype=np.int32)
    doc_index, sample_index, shuffle_index = G.build_indices(sizes, documents, num_samples, seq_length, 42)
    tokens = int(sizes[documents].sum())
    epochs = G.num_epochs_for(tokens, num_samples, seq_length)
    assert (epochs - 1) * tokens < num_samples * seq_length + 1 <= epochs * tokens
    assert sorted(doc_index.tolist()) == sorted(documents.tolist() * epochs)
    total = (epochs * tokens - 1) // seq_length
    assert len(sample_index) == total + 1 and total >= num_samples
    assert np.array_equal(sample_index, _reference_sample_index(sizes, doc_index, seq_length, total))
    assert sorted(shuffle_index.tolist()) == list(range(total))
    # every sample is the stream slice [k*L, k*L + L + 1) (one token of overlap)
    stream = np.concatenate([docs[d] for d in doc_index])
    ds = IndexedDatasetStub(docs)
    gpt = G.GPTDataset.__new__(G.GPTDataset)
    gpt.indexed, gpt.seq_length, gpt.split = ds, seq_length, "train"
    gpt.document_index, gpt.sample_index, gpt.shuffle_index = doc_index, sample_index, shuffle_index
    for i in range(len(gpt)):
        k = int(shuffle_index[i])
        assert np.array_equal(gpt[i]["text"], stream[k * seq_length: k * seq_length + seq_length + 1])


class IndexedDatasetStub:
    def __init__(self, docs):
        self.docs = docs

    def get(self, i, offset=0, length=None):
        d = self.docs[i]
        return d[offset:] if length is None else d[offset: offset + length]


def test_last_epoch_separation_rule():
    tokens, L = 1001, 10  # 100 samples per epoch
    # 2.5 epochs of samples -> 3 epochs, the last contributes 50 < 80 -> separate
    assert G.num_epochs_for(tokens, 250, L) == 3 and G.separate_last_epoch(3, tokens, 250, L)
    # 2.9 epochs -> last contributes 90 >= 80 -> shuffled together
    assert not G.separate_last_epoch(3, tokens, 290, L)
    assert G.separate_last_epoch(3, tokens, 279, L) and not G.separate_last_epoch(3, tokens, 280, L)
    assert not G.separate_last_epoch(1, tokens, 50, L)
    sizes = np.full(100, 10, dtype=np.int32)  # 1000 tokens, 99 samples per epoch
    doc_index, sample_index, shuffle_index = G.build_indices(sizes, np.arange(100, dtype=np.int32), 250, 10, 3)
    assert len(doc_index) == 300
    # the last epoch's documents are shuffled on their own: the last 100 entries are one full epoch
    assert sorted(doc_index[200:].tolist()) == list(range(100))
    before_last = (2 * 1000 - 1) // 10
    assert sorted(shuffle_index[:before_last].tolist()) == list(range(before_last))
    assert shuffle_index[before_last:].min() == before_last
    # with a larger request the epochs are mixed: the last 100 entries are not one epoch
    doc_index, _, _ = G.build_indices(sizes, np.arange(100, dtype=np.int32), 290, 10, 3)
    assert sorted(doc_index[200:].tolist()) != list(range(100))


def test_split_parsing_and_bounds():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    b = split_bounds(parse_split("90,10,0"))
    assert b[2] is None and split_documents(200, b[0]).tolist() == list(range(180))
    assert split_documents(200, b[1]).tolist() == list(range(180, 200))
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="--split"):
        parse_split("1,2,3,4")
    with pytest.raises(ValueError, match="--data-path"):
        parse_data_path(["0.3", "a", "b", "c"])


def test_blending_proportions():
    weights = [0.5, 0.3, 0.2]
    ds, sample = build_blending_indices(weights, 10000)
    counts = np.zeros(3)
    for t in range(1, 10001):
        counts[ds[t - 1]] += 1
        if t % 97 == 0:
            assert np.all(np.abs(counts - np.array(weights) * t) <= 1.0 + 1e-9), t
    for i in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert sample[ds == i].tolist() == list(range(int((ds == i).sum())))


def test_build_gpt_datasets_blend_and_none(tmp_path):
    a = _write(str(tmp_path / "a"), _docs(1, 100))
    b = _write(str(tmp_path / "b"), _docs(2, 80))
    train, valid, test = build_gpt_datasets(["1", a, "3", b], "90,10,0", 16, 5, (400, 0, 10),
                                            cache_dir=str(tmp_path / "cache"))
    assert valid is None and test is None  # 0 samples asked / 0 weight
    assert len(train) == 100 + 300  # sum of ceil(400 * w)
    # mid-level datasets were asked for a 0.5% surplus
    assert [d.num_samples for d in train.datasets] == [int(np.ceil(100 * 1.005)), int(np.ceil(300 * 1.005))]
    ids = np.array([train[i]["dataset_id"] for i in range(len(train))])
    assert (ids == 0).sum() == 100 and (ids == 1).sum() == 300
    assert all(train[i]["text"].shape == (17,) for i in range(0, 400, 37))
    with pytest.raises(ValueError, match="test split .* has 0 tokens"):
        build_gpt_datasets([a], "1000,0,1", 16, 5, (10, 0, 10))  # the test split of 100 docs rounds to none


def _dist_build(rank, world, prefix, cache):
    import torch.distributed as dist

    train, _, _ = build_gpt_datasets([prefix], "99,1,0", 16, 11, (300, 0, 0), cache_dir=cache,
                                     is_rank_0=rank == 0, barrier=dist.barrier)
    if rank != 0:
        assert isinstance(train.shuffle_index, np.memmap)  # loaded from rank 0's cache, not rebuilt
    got = torch.from_numpy(np.stack([train[i]["text"] for i in range(0, len(train), 7)]))
    ref = got.clone()
    dist.broadcast(ref, 0)
    assert torch.equal(got, ref)


def test_rank0_builds_others_mmap(tmp_path):
    prefix = _write(str(tmp_path / "d"), _docs(3, 120))
    run_distributed(_dist_build, 2, (prefix, str(tmp_path / "cache")))
    assert len([f for f in os.listdir(tmp_path / "cache") if f.endswith(".npy")]) == 3


def test_sampler_dp_sharding_and_resume():
    total, mbs, dp = 103, 2, 3
    per_rank = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    steps = len(per_rank[0])
    assert steps == total // (mbs * dp)  # the last incomplete global batch is dropped
    for s in range(steps):
        merged = [i for r in range(dp) for i in per_rank[r][s]]
        assert merged == list(range(s * mbs * dp, (s + 1) * mbs * dp))
    resumed = list(MegatronPretrainingSampler(total, 5 * mbs * dp, mbs, 1, dp))
    assert resumed == per_rank[1][5:]
    with pytest.raises(ValueError, match="data_parallel_rank"):
        MegatronPretrainingSampler(total, 0, mbs, 3, dp)


def test_data_loader_batches(tmp_path):
    prefix = _write(str(tmp_path / "d"), _docs(4, 50))
    train, _, _ = build_gpt_datasets([prefix], "1", 8, 1, (40, 0, 0))
    loader = build_pretraining_data_loader(train, consumed_samples=8, micro_batch_size=4, data_parallel_rank=1,
                                           data_parallel_size=2)
    batch = next(iter(loader))
    assert batch["text"].dtype == torch.int64 and batch["text"].shape == (4, 9)
    assert torch.equal(batch["text"][0], torch.from_numpy(train[12]["text"]))


def test_inspect_tool_json(tmp_path, capsys):
    import importlib.util
    import json

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("inspect_dataset", os.path.join(ROOT, "tools", "inspect_dataset.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    prefix = _write(str(tmp_path / "d"), _docs(5, 60))
    rc = tool.main(["--data-path", prefix, "--split", "90,10,0", "--seq-length", "8", "--seed", "3",
                    "--num-samples", "50", "5", "0", "--show", "2", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    train, valid, _ = build_gpt_datasets([prefix], "90,10,0", 8, 3, (50, 5, 0))
    assert report["train"]["len"] == len(train) and report["valid"]["len"] == len(valid)
    assert report["train"]["samples"] == [train[i]["text"].tolist() for i in range(2)]
    assert report["test"] == {"len": 0, "samples": []}
    assert all(len(s) == 9 for s in report["valid"]["samples"])
    rc = tool.main(["--data-path", prefix, "--split", "8,1,1", "--seq-length", "8", "--num-samples", "5", "1", "1",
                    "--show", "1"])
    assert rc == 0 and "=== train:" in capsys.readouterr().out


def test_build_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--data-path .*missing"):
        build_gpt_datasets([str(tmp_path / "missing")], "1", 8, 1, (4, 0, 0))
    prefix = _write(str(tmp_path / "d"), _docs(6, 10))
    with pytest.raises(ValueError, match="--seq-length"):
        build_gpt_datasets([prefix], "1", 0, 1, (4, 0, 0))


def test_empty_split_error_names_the_half_open_range_and_flag(tmp_path):
    """Megatron's default --split on a small corpus leaves the test split without documents."""
    prefix = _write(str(tmp_path / "d"), _docs(7, 300))
    with pytest.raises(ValueError, match=r"test split .* \(documents \[300, 300\) of 300 with --split 949,50,1"):
        build_gpt_datasets([prefix], "949,50,1", 8, 1, (10, 5, 1))
    train, valid, test = build_gpt_datasets([prefix], "949,50,1", 8, 1, (10, 5, 0))  # no test samples asked
    assert test is None and len(train) >= 10 and len(valid) >= 5


def test_dataset_modules_import_one_way():
    """Within megatron/core/datasets the imports form no cycle and no module imports another's private name."""
    import ast

    from tests.conftest import ROOT

    folder = os.path.join(ROOT, "megatron", "core", "datasets")
    graph = {}
    for name in os.listdir(folder):
        if not name.endswith(".py") or name == "__init__.py":
            continue
        tree = ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core.datasets."):
                deps.add(node.module.rsplit(".", 1)[1])
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports private {private} from {node.module}"
        graph[name[:-3]] = deps

    def reaches(start, target, seen):
        return any(d == target or (d not in seen and reaches(d, target, seen | {d})) for d in graph.get(start, ()))

    assert "builder" in graph and graph["builder"] >= {"gpt_dataset", "blended_dataset"}
    for module in graph:
        assert not reaches(module, module, set()), f"{module} imports itself through a cycle"
