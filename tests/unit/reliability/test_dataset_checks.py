"""Start-up data checks: token ids beyond the vocabulary, sentence-level data given to GPT."""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from megatron.core.datasets.checks import (check_gpt_dataset, check_token_ids, sentence_level_warning,
                                           token_range)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.conftest import ROOT, SHARED_DATA


def _build(prefix, docs, dtype, sentences=False):
    """docs: list of documents, each a list of sequences (lists of ids)."""
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        if sentences:
            b.add_document(np.concatenate(doc), [len(s) for s in doc])
        else:
            b.add_item(np.concatenate(doc))
            b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def _random_docs(rng, n_docs, high, sentences_per_doc=1):
    return [[rng.integers(0, high, size=int(rng.integers(1, 300))) for _ in range(sentences_per_doc)]
            for _ in range(n_docs)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_range_matches_numpy_over_many_chunks(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = _random_docs(rng, 400, 50000)
    prefix = _build(str(tmp_path / "d"), docs, dtype)
    every = np.concatenate([np.concatenate(d) for d in docs])
    for chunk in (8, 1000, 1 << 20):  # chunk boundaries everywhere, including one id per chunk
        found = token_range(prefix, chunk_bytes=chunk)
        assert (found.min_id, found.max_id, found.num_tokens) == (every.min(), every.max(), every.size)
        ds = IndexedDataset(prefix)
        assert found.max_id in ds[found.max_sequence]
        assert all(found.max_id not in ds[i] for i in range(found.max_sequence))


def test_id_beyond_vocabulary_names_file_id_and_sequence(tmp_path):
    rng = np.random.default_rng(1)
    docs = _random_docs(rng, 50, 1000)
    docs[17][0][5] = 50300
    docs[30][0][2] = 50300
    prefix = _build(str(tmp_path / "bad"), docs, np.uint16)
    with pytest.raises(ValueError) as info:
        check_token_ids(prefix, 50257, chunk_bytes=64)
    msg = str(info.value)
    assert msg.startswith(f"{prefix}.bin: token id 50300 (largest in the file, first in sequence 17) is not "
                          "below the model's vocabulary size 50257")
    assert "\n" not in msg
    assert check_token_ids(prefix, 50301).max_id == 50300


def test_negative_ids_and_dtypes_that_cannot_overflow(tmp_path):
    prefix = _build(str(tmp_path / "neg"), [[np.array([1, 2, -7, 3])]], np.int32)
    with pytest.raises(ValueError, match="negative token id -7"):
        check_token_ids(prefix, 100)
    prefix = _build(str(tmp_path / "u16"), [[np.array([65535, 0])]], np.uint16)
    assert check_token_ids(prefix, 65536) is None  # uint16 cannot exceed it: the .bin is not read
    with pytest.raises(ValueError, match="token id 65535"):
        check_token_ids(prefix, 65535)
    with pytest.raises(ValueError, match="must be positive"):
        check_token_ids(prefix, 0)


def test_sequences_not_stored_in_order(tmp_path):
    """A valid .idx may point at sequences in any order: the per-sequence path gives the same answer."""
    prefix = _build(str(tmp_path / "shuffled"), [[np.array([1, 2, 3])], [np.array([900, 5, 6])]], np.uint16)
    pointers = np.memmap(prefix + ".idx", dtype=np.int64, mode="r+", offset=34 + 2 * 4, shape=(2,))
    pointers[:] = [6, 0]  # sequence 0 is now the second half of the .bin, sequence 1 the first
    pointers.flush()
    del pointers
    ds = IndexedDataset(prefix)
    assert list(ds[0]) == [900, 5, 6] and list(ds[1]) == [1, 2, 3]
    found = token_range(ds)
    assert (found.min_id, found.max_id, found.max_sequence, found.num_tokens) == (1, 900, 0, 6)
    with pytest.raises(ValueError, match="token id 900 .*first in sequence 0"):
        check_token_ids(ds, 512)
    # three sequences spanning the .bin exactly, but out of order: the fast path would misplace the maximum
    prefix = _build(str(tmp_path / "perm"), [[np.array([1, 1])], [np.array([2, 700])], [np.array([3, 3])]],
                    np.uint16)
    pointers = np.memmap(prefix + ".idx", dtype=np.int64, mode="r+", offset=34 + 3 * 4, shape=(3,))
    pointers[:] = [4, 0, 8]  # sequence 0 now holds the 700
    pointers.flush()
    del pointers
    assert list(IndexedDataset(prefix)[0]) == [2, 700]
    assert token_range(prefix).max_sequence == 0


def test_empty_dataset(tmp_path):
    prefix = _build(str(tmp_path / "empty"), [], np.uint16)
    assert token_range(prefix) is None and check_token_ids(prefix, 10) is None


def test_sentence_level_data_for_gpt_warns(tmp_path):
    rng = np.random.default_rng(2)
    prefix = _build(str(tmp_path / "corpus_text_sentence"), _random_docs(rng, 10, 100, 3), np.uint16, True)
    msg = sentence_level_warning(prefix)
    assert msg == (f"{prefix}.idx (its name says _sentence) is sentence-level data: 30 sequences in 10 "
                   "documents, but GPT training reads one sequence per document; preprocess the corpus without "
                   "--split-sentences for it")
    with pytest.warns(UserWarning, match="sentence-level data: 30 sequences in 10 documents"):
        assert check_gpt_dataset(prefix, 100).max_id < 100
    doc_prefix = _build(str(tmp_path / "corpus_text_document"), _random_docs(rng, 10, 100), np.uint16)
    assert sentence_level_warning(doc_prefix) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_gpt_dataset(doc_prefix, 100)


@pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="shared data folder (GPT-2 vocabulary) not present")
def test_real_preprocessed_corpus(tmp_path):
    """tools/preprocess_data.py output of a real text: every id is a GPT-2 id, EOD is the largest."""
    src = os.path.join(SHARED_DATA, "corpus", "tinyshakespeare.txt")
    text = open(src, encoding="utf-8").read()[:200_000]
    jsonl = tmp_path / "tiny.jsonl"
    import json
    with open(jsonl, "w") as f:
        for part in text.split("\n\n"):
            f.write(json.dumps({"text": part}) + "\n")
    gpt2 = os.path.join(SHARED_DATA, "gpt2")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(jsonl),
                    "--output-prefix", str(tmp_path / "tiny"), "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", os.path.join(gpt2, "vocab.json"), "--merge-file",
                    os.path.join(gpt2, "merges.txt"), "--append-eod", "--workers", "1", "--quiet"],
                   check=True, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True)
    prefix = str(tmp_path / "tiny_text_document")
    assert check_token_ids(prefix, 50304).max_id == 50256  # <|endoftext|> appended to every document
    with pytest.raises(ValueError, match="token id 50256 .* vocabulary size 50000"):
        check_token_ids(prefix, 50000)


def test_damaged_index_body_and_cached_index_name_the_file(tmp_path):
    """A damaged .idx body (the header and the size still right) and a truncated cached index array: one error
    naming the file, at open."""
    rng = np.random.default_rng(0)
    prefix = _build(str(tmp_path / "corpus"), [[rng.integers(0, 500, size=50)] for _ in range(40)], np.uint16)
    assert len(IndexedDataset(prefix)) == 40
    with open(prefix + ".idx", "r+b") as f:
        f.seek(34 + 40 * 4 + 8 * 7)  # the pointer of sequence 7
        f.write(np.int64(1 << 40).tobytes())
    with pytest.raises(ValueError, match=f"^{prefix}.idx: corrupt index: sequence 7 \\(length 50, at byte "
                                         f"1099511627776\\) does not lie inside the 4000 bytes of {prefix}.bin$"):
        IndexedDataset(prefix)

    from megatron.core.datasets.index_cache import IndexCache

    cache = IndexCache(str(tmp_path / "cache"), {"n": 1}, "GPTDataset", "train", ["doc_idx"])
    cache.save({"doc_idx": np.arange(1000, dtype=np.int64)})
    path = cache.paths()["doc_idx"]
    assert list(cache.load()["doc_idx"][:3]) == [0, 1, 2]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=f"^cached index file {path} is damaged \\(.*\\); delete it and it is "
                                         "built again$"):
        cache.load()
