"""preprocess_data.py / merge_datasets.py: Megatron-identical output, bad input, partitions, sentences."""

import gzip
import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets import IndexedDataset
from megatron.core.datasets import preprocessing as P
from megatron.core.datasets.indexed_dataset import optimal_dtype
from megatron.core.tokenizer import build_tokenizer
from tests.conftest import ROOT
from tests.unit.data.shared_files import shared_file

VOCAB = os.path.join(ROOT, "data", "gpt2-vocab.json")
MERGES = os.path.join(ROOT, "data", "gpt2-merges.txt")
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "preprocess_golden.json")


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _cfg(inp, prefix, **kw):
    base = dict(input=str(inp), output_prefix=str(prefix), tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB,
                merge_file=MERGES, append_eod=True, workers=1, quiet=True)
    base.update(kw)
    return P.PreprocessConfig(**base)


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")


def _parse_idx(path):
    """Independent struct-based reader of the documented .idx layout."""
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, s, d = struct.unpack_from("<QBQQ", raw, 9)
    off = 34
    lengths = struct.unpack_from(f"<{s}i", raw, off)
    off += 4 * s
    pointers = struct.unpack_from(f"<{s}q", raw, off)
    off += 8 * s
    docs = struct.unpack_from(f"<{d}q", raw, off)
    assert off + 8 * d == len(raw)
    return version, code, list(lengths), list(pointers), list(docs)


def test_prose_prefix_byte_identical_to_megatron(tmp_path):
    """First 1,500 documents of prose.jsonl, 2 workers: the files Megatron-LM's procedure writes."""
    golden = json.load(open(GOLDEN))
    src = tmp_path / "prose_head.jsonl"
    with gzip.open(shared_file("corpus", "prose.jsonl.gz"), "rt", encoding="utf-8") as f, \
            open(src, "w", encoding="utf-8") as g:
        for i, line in zip(range(golden["first_lines"]), f):
            g.write(line)
    stats = P.preprocess(_cfg(src, tmp_path / "prose", workers=2))
    out = str(tmp_path / "prose_text_document")
    assert stats.documents == golden["first_lines"] and stats.bad_count == 0
    assert os.path.getsize(out + ".bin") == golden["first"]["bin_bytes"]
    assert _sha(out + ".bin") == golden["first"]["bin_sha256"]
    assert _sha(out + ".idx") == golden["first"]["idx_sha256"]


def test_format_round_trip_and_eod(tmp_path):
    tok = build_tokenizer("GPT2BPETokenizer", VOCAB, MERGES)
    texts = ["Hello world.", "", "Second document,\nwith two lines.", "x" * 10]
    _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "out"))
    prefix = str(tmp_path / "out_text_document")
    version, code, lengths, pointers, docs = _parse_idx(prefix + ".idx")
    expected = [tok.tokenize(t) + [tok.eod] for t in texts if t]
    assert (version, code) == (1, 8)  # uint16
    assert lengths == [len(e) for e in expected]
    assert pointers == list(np.cumsum([0] + lengths[:-1]) * 2)
    assert docs == [0, 1, 1, 2, 3]  # the empty text is an empty document, as in Megatron-LM
    raw = np.fromfile(prefix + ".bin", dtype="<u2")
    assert raw.tolist() == [i for e in expected for i in e]
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds[1].tolist() == expected[1]
    assert ds.get(1, 2, 3).tolist() == expected[1][2:5]
    assert ds.document_indices.tolist() == docs and ds.sequence_lengths.tolist() == lengths


def test_dtype_choice(tmp_path):
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(None) == np.int32
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70000)}
    vocab["[UNK]"] = 70000
    vocab["</s>"] = 70001
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.save(str(tmp_path / "tokenizer.json"))
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "w1 w69999 w5"}])
    P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "big", tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=str(tmp_path / "tokenizer.json")))
    version, code, lengths, _, _ = _parse_idx(str(tmp_path / "big_text_document.idx"))
    assert code == 4  # int32
    assert IndexedDataset(str(tmp_path / "big_text_document"))[0].tolist() == [1, 69999, 5, 70001]


def test_bad_input_reported_with_line_numbers(tmp_path, capsys):
    rows = [{"text": "good one"}, "{not json", {"other": "x"}, {"text": 5}, "", {"text": ["a", 3]},
            "[1, 2]", {"text": "good two"}, '{"text": "\\ud800 lone surrogate"}']
    _write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = _cfg(tmp_path / "bad.jsonl", tmp_path / "out")
    cfg.quiet = False
    stats = P.preprocess(cfg)
    err = capsys.readouterr().err
    assert stats.documents == 2 and stats.bad_count == 6 and stats.blank_lines == 1
    assert [b.line for b in stats.bad] == [2, 3, 4, 6, 7, 9]
    for needle in ("line 2: malformed JSON", "line 3: missing key 'text'", "line 4: key 'text' is int",
                   "line 6: key 'text' is list", "line 7: expected a JSON object", "line 9: text is not valid"):
        assert needle in err
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 2


def _leftovers(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith((".bin", ".idx", ".tmp")))


def test_strict_fails_without_complete_looking_output(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "BATCH_BYTES", 64)  # many batches: part of the output is written before the error
    rows = [{"text": f"document number {i} " * 5} for i in range(40)] + ["{broken"] + [{"text": "after"}]
    _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(P.BadInputError, match="line 41"):
        P.preprocess(_cfg(tmp_path / "in.jsonl", out / "x", strict=True, workers=2))
    assert _leftovers(out) == []
    # an older complete pair under the same name is removed too: it must not pass for the new output
    P.preprocess(_cfg(tmp_path / "in.jsonl", out / "x"))
    assert _leftovers(out) == ["x_text_document.bin", "x_text_document.idx"]
    with pytest.raises(P.BadInputError):
        P.preprocess(_cfg(tmp_path / "in.jsonl", out / "x", strict=True))
    assert _leftovers(out) == []


def test_cli_quickstart_gz_and_merge(tmp_path):
    """The quickstart command on the bundled corpus; .gz equals plain; merging two halves equals the whole."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
           os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "--output-prefix", str(tmp_path / "quickstart"),
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES, "--append-eod",
           "--workers", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    whole = IndexedDataset(str(tmp_path / "quickstart_text_document"))
    assert len(whole) == 903 and "docs/s" in r.stderr and "MB/s" in r.stderr
    with gzip.open(os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "rt", encoding="utf-8") as f:
        lines = f.readlines()
    (tmp_path / "parts").mkdir()
    for name, chunk in (("a", lines[:400]), ("b", lines[400:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(chunk), encoding="utf-8")
        P.preprocess(_cfg(tmp_path / f"{name}.jsonl", tmp_path / "parts" / name))
    merge = [sys.executable, os.path.join(ROOT, "tools", "merge_datasets.py"), "--input", str(tmp_path / "parts"),
             "--output-prefix", str(tmp_path / "merged")]
    r = subprocess.run(merge, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for ext in (".bin", ".idx"):
        assert _sha(str(tmp_path / "merged") + ext) == _sha(str(tmp_path / "quickstart_text_document") + ext)


def test_partitions_deal_documents_round_robin(tmp_path):
    rows = [{"text": f"doc {i}"} for i in range(7)]
    _write_jsonl(tmp_path / "in.jsonl", rows)
    P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "p", partitions=3, append_eod=False))
    ds = IndexedDataset(str(tmp_path / "p_text_document"))
    tok = build_tokenizer("GPT2BPETokenizer", VOCAB, MERGES)
    order = [0, 3, 6, 1, 4, 2, 5]  # partition 0 = lines 1,4,7; partition 1 = lines 2,5; ...
    assert [ds[i].tolist() for i in range(7)] == [tok.tokenize(f"doc {i}") for i in order]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "p_text_document.bin", "p_text_document.idx"]


def test_split_sentences_offline(tmp_path, monkeypatch):
    import nltk

    def no_network(*a, **k):
        raise AssertionError("Punkt parameters must not be downloaded or loaded from nltk_data")

    monkeypatch.setattr(nltk, "download", no_network)
    monkeypatch.setattr(nltk.data, "load", no_network)
    text = "Dr. Smith went to Washington. He arrived at 5 p.m. on Monday.\n\nThe meeting was long. It ended."
    _write_jsonl(tmp_path / "in.jsonl", [{"text": text}, {"text": ["Already split.", "Two sentences."]},
                                         {"text": ["A list is never re-split. Even of one."]}])
    P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "s", split_sentences=True))
    ds = IndexedDataset(str(tmp_path / "s_text_sentence"))
    tok = build_tokenizer("GPT2BPETokenizer", VOCAB, MERGES)
    sents = ["Dr. Smith went to Washington.", "He arrived at 5 p.m. on Monday.", "The meeting was long.",
             "It ended."]
    want = [tok.tokenize(s) for s in sents]
    want[-1] = want[-1] + [tok.eod]
    assert [ds[i].tolist() for i in range(4)] == want
    assert ds.document_indices.tolist() == [0, 4, 6, 7]
    P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "k", split_sentences=True, keep_newlines=True,
                      append_eod=False))
    kept = IndexedDataset(str(tmp_path / "k_text_sentence"))
    assert tok.detokenize(np.concatenate([kept[i] for i in range(4)]).tolist()) == text


def test_bert_tokenizer_preprocess(tmp_path):
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "Hello World."}, {"text": "Second."}])
    vocab = shared_file("bert", "vocab.txt")
    P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "b", tokenizer_type="BertWordPieceLowerCase",
                      vocab_file=vocab, merge_file=None))
    ds = IndexedDataset(str(tmp_path / "b_text_document"))
    assert ds[0].tolist() == [7592, 2088, 1012, 30523] and ds.dtype == np.uint16


def test_flag_errors(tmp_path):
    with pytest.raises(ValueError, match="--input"):
        P.preprocess(_cfg(tmp_path / "missing.jsonl", tmp_path / "x"))
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(ValueError, match="--workers"):
        P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "x", workers=0))
    with pytest.raises(ValueError, match="--output-prefix"):
        P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "nodir" / "x"))


def test_bert_sentences_byte_identical_to_megatron(tmp_path):
    """--split-sentences with BertWordPieceLowerCase on real prose (plus an empty document and a literal [EOS])
    writes the files of Megatron-LM's procedure with its own BERT tokenizer (golden/make_bert_preprocess_golden.py)."""
    golden = json.load(open(os.path.join(os.path.dirname(GOLDEN), "bert_preprocess_golden.json")))
    vocab = shared_file("bert", "vocab.txt")
    src = tmp_path / "prose_head.jsonl"
    with gzip.open(shared_file("corpus", "prose.jsonl.gz"), "rt", encoding="utf-8") as f, \
            open(src, "w", encoding="utf-8") as g:
        g.writelines([line for _, line in zip(range(golden["first_lines"]), f)] + golden["extra_lines"])
    P.preprocess(_cfg(src, tmp_path / "ours", tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab,
                      merge_file=None, split_sentences=True, append_eod=False, workers=2))
    got = str(tmp_path / "ours_text_sentence")
    assert os.path.getsize(got + ".bin") == golden["bin_bytes"] and os.path.getsize(got + ".idx") == golden["idx_bytes"]
    assert _sha(got + ".bin") == golden["bin_sha256"] and _sha(got + ".idx") == golden["idx_sha256"]
    assert len(IndexedDataset(got)) > 5 * golden["first_lines"]  # several sentences per document


def test_runs_in_one_process_do_not_leak_settings(tmp_path):
    """A --split-sentences run followed by a plain run in the same process: the second writes documents."""
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "First sentence. Second sentence."}, {"text": "Third one."}])
    P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "s", split_sentences=True))
    for workers in (1, 2):
        P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / f"d{workers}", workers=workers))
        ds = IndexedDataset(str(tmp_path / f"d{workers}_text_document"))
        assert len(ds) == 2 and ds.document_indices.tolist() == [0, 1, 2]


def test_howto_flags_vocab_and_chunk_size(tmp_path):
    """The older how-tos' command line (``--vocab``, ``--chunk-size``) runs with one note each and writes what
    ``--vocab-file`` writes; ``--vocab`` contradicting ``--vocab-file`` is one error line."""
    _write_jsonl(tmp_path / "in.jsonl", [{"text": f"Document {i}: to be, or not to be."} for i in range(50)])
    script = os.path.join(ROOT, "tools", "preprocess_data.py")
    cmd = [sys.executable, script, "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "howto"),
           "--vocab", VOCAB, "--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer", "--merge-file",
           MERGES, "--json-keys", "text", "--workers", "2", "--chunk-size", "25", "--append-eod"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert notes == [f"note: --vocab is read as --vocab-file {VOCAB} (Megatron-LM's abbreviation of it)",
                     "note: --chunk-size 25 has no effect: the workers take the input in byte ranges and the output "
                     "is the same for any chunking"]
    P.preprocess(_cfg(tmp_path / "in.jsonl", tmp_path / "plain"))
    for ext in (".bin", ".idx"):
        assert _sha(str(tmp_path / "howto_text_document") + ext) == _sha(str(tmp_path / "plain_text_document") + ext)
    r = subprocess.run(cmd + ["--vocab-file", MERGES], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        f"error: --vocab {VOCAB} (the older spelling of --vocab-file) contradicts --vocab-file {MERGES}")
