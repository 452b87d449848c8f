"""BERT masked-LM samples equal Megatron-Core 0.16.1's BERTMaskedWordPieceDataset (golden/make_bert_golden.py)."""

import hashlib
import json
import os
import sys

import numpy as np
import pytest

from megatron.core.datasets import (
    BertDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    MaskingConfig,
    WordPieceVocab,
    build_bert_datasets,
)
from megatron.core.datasets.bert_samples import MT19937_64, build_sample_map, mt19937_words
from megatron.core.datasets.indexed_dataset import optimal_dtype

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
sys.path.insert(0, HERE)
from bert_golden_spec import CONFIGS, SHOW, sentence_documents, vocab_tokens  # noqa: E402

with open(os.path.join(HERE, "bert_golden.json")) as _f:
    GOLDEN = json.load(_f)
FIELDS = GOLDEN["fields"]
VOCAB = WordPieceVocab.from_vocab({t: i for i, t in enumerate(vocab_tokens())})


def _sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _file_sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _write(prefix, docs, vocab_size):
    b = IndexedDatasetBuilder(prefix + ".bin", optimal_dtype(vocab_size))
    for doc in docs:
        for sentence in doc:
            b.add_item(sentence)
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    return {name: _write(str(root / name), sentence_documents(name), GOLDEN["vocab_size"]) for name in ("S", "T")}


def _config(c, vocab=VOCAB):
    masking = MaskingConfig(mask_prob=c["mask_prob"], max_ngram=c["max_ngram"], whole_word=c["whole_word"])
    return BertDatasetConfig(seq_length=c["seq_length"], seed=c["seed"], vocab=vocab,
                             short_seq_prob=c["short_seq_prob"], binary_head=c["binary_head"], masking=masking)


def _compare(datasets, want_splits):
    for split, ds in zip(("train", "valid", "test"), datasets):
        want = want_splits[split]
        if want is None:
            assert ds is None, split
            continue
        assert len(ds) == want["len"], split
        items = [ds[i] for i in range(len(ds))]
        for k, (got, exp) in enumerate(zip(items, want["first"])):
            for field, value in exp.items():
                if field == "dataset_id":
                    assert got["dataset_id"] == value
                    continue
                got_value = got[field].tolist() if isinstance(got[field], np.ndarray) else got[field]
                assert got_value == value, f"{split}[{k}].{field}"
        flat = np.concatenate([np.concatenate([it[f] for f in FIELDS] + [np.array([it["is_random"], it["truncated"]])])
                               for it in items])
        assert _sha(flat.astype(np.int64)) == want["all_sha256"], split


def test_vocab_and_files_as_megatron(prefixes):
    assert GOLDEN["vocab_size"] == len(vocab_tokens()) == VOCAB.lookup.size
    for name, p in prefixes.items():
        assert _file_sha(p + ".bin") == GOLDEN["files"][name]["bin_sha256"], name
        assert _file_sha(p + ".idx") == GOLDEN["files"][name]["idx_sha256"], name


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_samples_equal_megatron_core(prefixes, config, tmp_path):
    c = CONFIGS[config]
    data_path = [prefixes.get(x, x) for x in c["data_path"]]
    cache = str(tmp_path / "cache")
    datasets = build_bert_datasets(data_path, c["split"], _config(c), c["sizes"], cache_dir=cache)
    _compare(datasets, GOLDEN["configs"][config])
    assert GOLDEN["configs"][config]["train"]["first"][0]["text"][0] == VOCAB.cls
    # the second build memory-maps the cached sample map and gives the same items
    again = build_bert_datasets(data_path, c["split"], _config(c), c["sizes"], cache_dir=cache)
    last = len(again[0]) - 1
    assert all(np.array_equal(again[0][last][f], datasets[0][last][f]) for f in FIELDS)
    for ds in getattr(again[0], "datasets", [again[0]]):
        assert isinstance(ds.sample_index, np.memmap)  # loaded from the cache, not rebuilt


def test_real_sentence_data_equals_megatron_core(tmp_path):
    """The binary-head configuration on real text: prose.jsonl sentence-split with bert-base-uncased."""
    if "real" not in GOLDEN:
        pytest.skip("the golden file has no real-data record")
    from megatron.core.datasets import preprocessing as P
    from megatron.core.tokenizer import build_tokenizer
    from tests.unit.data.shared_files import shared_file

    vocab_file = shared_file("bert", "vocab.txt")
    prefix = _real_sentence_data(tmp_path, shared_file("corpus", "prose.jsonl.gz"), vocab_file, P)
    real = GOLDEN["real"]
    assert _file_sha(prefix + ".bin") == real["bin_sha256"] and _file_sha(prefix + ".idx") == real["idx_sha256"]
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_file)
    vocab = WordPieceVocab.from_tokenizer(tok)
    assert vocab.lookup.size == real["vocab_size"] == 30524
    c = real["config"]
    _compare(build_bert_datasets([prefix], c["split"], _config(c, vocab), c["sizes"]), real["splits"])


REAL_LINES = 120


def _real_sentence_data(tmp_path, corpus, vocab_file, P):
    import gzip

    src = tmp_path / "prose_head.jsonl"
    with gzip.open(corpus, "rt", encoding="utf-8") as f, open(src, "w", encoding="utf-8") as g:
        for _, line in zip(range(REAL_LINES), f):
            g.write(line)
    P.preprocess(P.PreprocessConfig(input=str(src), output_prefix=str(tmp_path / "prose"),
                                    tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab_file, merge_file=None,
                                    split_sentences=True, workers=1, quiet=True))
    return str(tmp_path / "prose_text_sentence")


def test_generators_equal_the_cpp_standard():
    """The 10,000th output of default-seeded std::mt19937 and std::mt19937_64 (C++ standard [rand.predef])."""
    assert int(mt19937_words(5489, 10000)[-1]) == 4123659995
    assert int(MT19937_64(5489).words(10000)[-1]) == 9981545732273789042


def test_sample_map_rules():
    """Sentences of one document per sample, targets within bounds, every sentence of a used document once."""
    docs = [[5, 7, 3], [40], [], [9, 9, 9, 9, 9, 9], [600, 2], [3, 3]]
    bounds = np.concatenate(([0], np.cumsum([len(d) for d in docs])))
    lengths = np.array([x for d in docs for x in d])
    m = build_sample_map(bounds, lengths, None, 12, 0.5, 3, 2)
    starts = sorted(m[:, 0].tolist())
    covered = sorted(s for a, b, _ in m.tolist() for s in range(a, b))
    # documents 0, 3 and 5 are used: 1 has one sentence, 2 none, 4 a sentence over 512 tokens
    assert covered == [0, 1, 2, 4, 5, 6, 7, 8, 9, 12, 13]
    for a, b, t in m.tolist():
        doc = int(np.searchsorted(bounds, a, side="right")) - 1
        assert b <= bounds[doc + 1] and b - a >= 2 and 2 <= t <= 12
    assert len(starts) == m.shape[0]
    longer = build_sample_map(bounds, lengths, 20, 12, 0.5, 3, 2)  # whole epochs until 20 samples
    epochs = int((longer[:, 0] == 0).sum())  # every epoch has one sample starting at sentence 0
    cover = np.bincount([s for a, b, _ in longer.tolist() for s in range(a, b)], minlength=14)
    assert longer.shape[0] >= 20 and epochs >= 2 and cover[covered].tolist() == [epochs] * len(covered)


def test_bad_input_one_clear_line(tmp_path):
    gpt = tmp_path / "gpt_text_document"
    _write(str(gpt), [[list(range(5, 40))] for _ in range(20)], 507)
    c = CONFIGS["binary_head"]
    with pytest.raises(ValueError, match=r"--data-path .*gpt_text_document: every document is a single sequence.*"
                                         r"--split-sentences"):
        build_bert_datasets([str(gpt)], "1", _config(c), (10, 0, 0))
    with pytest.raises(ValueError, match=r"vocabulary lacks \[MASK\]"):
        WordPieceVocab.from_vocab({t: i for i, t in enumerate(vocab_tokens()) if t != "[MASK]"}, "vocab.txt")
    with pytest.raises(ValueError, match=r"--seq-length 4 is too short .*\[CLS\] A \[SEP\] B \[SEP\]"):
        BertDatasetConfig(seq_length=4, seed=1, vocab=VOCAB)
    one = tmp_path / "one_text_sentence"  # sentence data, but no usable document has two sentences
    _write(str(one), [[[5] * 600, [6]]] + [[[7, 8]]] * 5, 507)
    with pytest.raises(ValueError, match=r"no document has 2 or more sentences.*--bert-no-binary-head"):
        build_bert_datasets([str(one)], "1", _config({**c, "binary_head": True}), (10, 0, 0))


def test_inspect_tool_bert_json_equals_megatron_core(prefixes, tmp_path, capsys):
    """tools/inspect_dataset.py --dataset-type bert with pretrain_bert's flags prints Megatron-Core's samples."""
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("inspect_dataset", os.path.join(ROOT, "tools", "inspect_dataset.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("\n".join(vocab_tokens()[:-2]) + "\n")  # the tokenizer appends [BOS] and [EOS]
    for name, flags in (("binary_head", []),
                        ("no_binary_head_single_tokens", ["--bert-no-binary-head", "--no-whole-word-masking",
                                                          "--masking-max-ngram", "1"])):
        c = CONFIGS[name]
        argv = ["--dataset-type", "bert", "--data-path", prefixes["S"], "--vocab-file", str(vocab_file),
                "--split", c["split"], "--seq-length", str(c["seq_length"]), "--seed", str(c["seed"]),
                "--num-samples", *map(str, c["sizes"]), "--mask-prob", str(c["mask_prob"]),
                "--short-seq-prob", str(c["short_seq_prob"]), "--show", str(SHOW), "--json", *flags]
        assert tool.main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        for split in ("train", "valid", "test"):
            want = GOLDEN["configs"][name][split]
            if want is None:
                assert report[split] == {"len": 0, "samples": []}
            else:
                assert report[split] == {"len": want["len"], "samples": want["first"]}, (name, split)
    with pytest.raises(SystemExit):  # argparse: --dataset-type bert needs --vocab-file
        tool.main(["--dataset-type", "bert", "--data-path", prefixes["S"], "--seq-length", "64",
                   "--num-samples", "1", "0", "0"])
    assert "needs --vocab-file" in capsys.readouterr().err
    assert tool.main(["--dataset-type", "bert", "--data-path", prefixes["S"], "--vocab-file", str(vocab_file),
                      "--seq-length", "4", "--num-samples", "1", "0", "0"]) == 1
    assert capsys.readouterr().err.strip().startswith("error: --seq-length 4 is too short")


def test_python_loops_equal_c(monkeypatch):
    """Without a C compiler the Python walk and Fisher-Yates give the C loops' sample map."""
    from megatron.core.datasets import bert_samples

    rs = np.random.RandomState(4)
    counts = rs.randint(0, 9, size=400)
    lengths = rs.randint(1, 50, size=int(counts.sum()))
    bounds = np.concatenate(([0], np.cumsum(counts)))
    if bert_samples._load_c() is None:
        pytest.skip("no C compiler (or MEGATRON_NO_C_HELPERS=1): the Python loops are the only ones")
    with_c = [build_sample_map(bounds, lengths, n, 61, p, 17, m) for n, p, m in ((5000, 0.1, 2), (None, 0.5, 1))]
    monkeypatch.setattr(bert_samples, "_load_c", lambda: None)
    without = [build_sample_map(bounds, lengths, n, 61, p, 17, m) for n, p, m in ((5000, 0.1, 2), (None, 0.5, 1))]
    assert all(np.array_equal(a, b) for a, b in zip(with_c, without)) and with_c[0].shape[0] >= 5000


def test_data_loader_batches_bert_fields(prefixes):
    import torch

    from megatron.core.datasets import build_pretraining_data_loader

    c = CONFIGS["binary_head"]
    train, _, _ = build_bert_datasets([prefixes["S"]], c["split"], _config(c), c["sizes"])
    batch = next(iter(build_pretraining_data_loader(train, consumed_samples=4, micro_batch_size=2,
                                                    data_parallel_rank=1, data_parallel_size=2)))
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "text": (2, 64), "types": (2, 64), "labels": (2, 64), "loss_mask": (2, 64), "padding_mask": (2, 64),
        "is_random": (2,), "truncated": (2,)}
    assert all(v.dtype == torch.int64 for v in batch.values())
    assert torch.equal(batch["labels"][0], torch.from_numpy(train[6]["labels"]))


def _dist_build(rank, world, prefix, cache):
    import torch
    import torch.distributed as dist

    c = CONFIGS["binary_head"]
    train, _, _ = build_bert_datasets([prefix], c["split"], _config(c), c["sizes"], cache_dir=cache,
                                      is_rank_0=rank == 0, barrier=dist.barrier)
    if rank != 0:
        assert isinstance(train.sample_index, np.memmap)  # rank 0's cached map, not rebuilt
    got = torch.from_numpy(np.stack([train[i]["text"] for i in range(0, len(train), 9)]))
    ref = got.clone()
    dist.broadcast(ref, 0)
    assert torch.equal(got, ref)


def test_rank0_builds_others_mmap(prefixes, tmp_path):
    from tests.dist_utils import run_distributed

    run_distributed(_dist_build, 2, (prefixes["S"], str(tmp_path / "cache")))
    assert [f.endswith("-sample_index.npy") for f in os.listdir(tmp_path / "cache")].count(True) == 3  # train, valid, test


@pytest.mark.parametrize("mask_prob", [0.15, 0.4])
def test_masked_positions_stay_within_the_model_bound(prefixes, mask_prob):
    """The model projects ``max_masked_positions(--mask-prob, --seq-length)`` positions per sample: no sample of
    the real dataset (with and without the binary head, short targets included) or of ``--mock-data`` masks more,
    and the bound is reached (it is not loose)."""
    from dataclasses import replace

    from megatron.core.models.bert_loss import max_masked_positions
    from megatron.training.mock_bert_data import mock_bert_datasets

    most = {}
    for name in ("binary_head", "no_binary_head_ngrams"):
        c = dict(CONFIGS[name], mask_prob=mask_prob)
        data_path = [prefixes.get(x, x) for x in c["data_path"]]
        config = _config(c)
        limit = max_masked_positions(mask_prob, c["seq_length"])
        datasets = build_bert_datasets(data_path, c["split"], config, c["sizes"])
        mock = mock_bert_datasets([200, 0, 0], replace(config, seed=3))
        for kind, ds in (("data", datasets[0]), ("mock", mock[0])):
            counts = [int(ds[i]["loss_mask"].sum()) for i in range(len(ds))]
            assert max(counts) <= limit, (name, kind, max(counts), limit)
            most[(name, kind)] = (max(counts), limit)
    assert any(count == limit for count, limit in most.values()), most
