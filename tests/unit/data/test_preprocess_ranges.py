"""Byte-range mode of preprocessing (several workers reading one plain file): the same files, counts and bad-line
numbers as the single-process stream, whatever the range and chunk sizes."""

import json
import os

import pytest

from megatron.core.datasets import preprocessing as P
from tests.conftest import ROOT

VOCAB = os.path.join(ROOT, "data", "gpt2-vocab.json")
MERGES = os.path.join(ROOT, "data", "gpt2-merges.txt")


def _cfg(inp, prefix, **kw):
    base = dict(input=str(inp), output_prefix=str(prefix), tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB,
                merge_file=MERGES, append_eod=True, workers=1, quiet=True)
    base.update(kw)
    return P.PreprocessConfig(**base)


def _corpus(path, trailing_newline=True):
    """Documents of very different lengths, blank lines, CRLF, bad lines and a list value (sentences)."""
    lines = []
    for i in range(120):
        if i % 17 == 5:
            lines.append("{not json")
        elif i % 23 == 7:
            lines.append("")
        elif i % 29 == 3:
            lines.append(json.dumps({"other": i}))
        elif i % 31 == 11:
            lines.append(json.dumps({"text": ["first sentence.", "", "second one!"]}))
        else:
            body = f"Document {i}: it's café time, 12,345 items\n\n" * (1 + (i * 7) % 40)
            lines.append(json.dumps({"text": body}) + ("\r" if i % 13 == 0 else ""))
    lines.append(json.dumps({"text": ""}))  # an empty document is kept (no tokens, no EOD)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + ("\n" if trailing_newline else ""))


def _files(prefix):
    out = []
    for ext in (".bin", ".idx"):
        with open(f"{prefix}_text_document{ext}", "rb") as f:
            out.append(f.read())
    return out


def test_line_ranges_cover_the_file_at_line_starts(tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    _corpus(path, trailing_newline=False)
    data = path.read_bytes()
    for range_bytes in (1, 100, 997, 1 << 20):
        monkeypatch.setattr(P, "RANGE_BYTES", range_bytes)
        ranges = P._line_ranges(str(path), 3)
        assert ranges[0][1] == 0 and ranges[-1][2] == len(data)
        for (_, a, b), (_, c, _) in zip(ranges, ranges[1:]):
            assert b == c and a < b and data[b - 1:b] == b"\n"  # contiguous, each next one starts a line
        assert len(ranges) >= min(6, data.count(b"\n"))


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_range_mode_equals_single_process(tmp_path, monkeypatch, trailing_newline):
    path = tmp_path / "in.jsonl"
    _corpus(path, trailing_newline)
    ref = P.preprocess(_cfg(path, tmp_path / "ref"))  # one process, streamed batches
    assert ref.bad_count > 5 and ref.blank_lines > 3
    calls = []
    real = P._line_ranges
    monkeypatch.setattr(P, "_line_ranges", lambda *a: calls.append(a) or real(*a))
    for range_bytes, chunk_bytes in ((1 << 20, 1 << 20), (3000, 700), (50, 1)):
        monkeypatch.setattr(P, "RANGE_BYTES", range_bytes)
        monkeypatch.setattr(P, "CHUNK_BYTES", chunk_bytes)  # read by the forked workers
        got = P.preprocess(_cfg(path, tmp_path / "got", workers=2))
        assert _files(tmp_path / "got") == _files(tmp_path / "ref")
        assert (got.documents, got.tokens, got.blank_lines, got.bad_count) == \
            (ref.documents, ref.tokens, ref.blank_lines, ref.bad_count)
        assert [(b.line, b.reason) for b in got.bad] == [(b.line, b.reason) for b in ref.bad]
    assert len(calls) == 3  # the byte-range mode really ran


def test_range_mode_strict_names_the_first_bad_line(tmp_path, monkeypatch):
    rows = [json.dumps({"text": f"document {i} " * 20}) for i in range(60)]
    rows[44] = "{broken"
    rows[52] = "[1]"
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    monkeypatch.setattr(P, "RANGE_BYTES", 200)
    monkeypatch.setattr(P, "CHUNK_BYTES", 100)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(P.BadInputError, match="line 45: malformed JSON"):
        P.preprocess(_cfg(tmp_path / "in.jsonl", out / "x", strict=True, workers=3))
    assert sorted(os.listdir(out)) == []  # nothing that looks like a complete output
