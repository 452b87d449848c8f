"""BERT end to end on real text: sentence-split preprocessing, then pretrain_bert.py through the real loop.

- The bundled ``data/tinyshakespeare.jsonl.gz`` with an 8,000-entry WordPiece vocabulary trained here (the
  ``tokenizers`` library): always runs.
- A slice of the shared prose corpus with bert-base-uncased's vocabulary: skipped without ``../shared/data``.
- GPT ``_document`` data given to pretrain_bert.py under ``torchrun --nproc_per_node 2``: one ``error:`` line.
"""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import SHARED_DATA
from tests.functional.harness import run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pretrain_bert  # noqa: E402

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _env():
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _preprocess(jsonl: str, prefix: str, vocab: str, split_sentences: bool = True) -> str:
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
           "--output-prefix", prefix, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
           "--workers", "1"] + (["--split-sentences"] if split_sentences else [])
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL)
    return prefix + ("_text_sentence" if split_sentences else "_text_document")


def _shakespeare_jsonl(path) -> str:
    with gzip.open(os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "rb") as f:
        path.write_bytes(f.read())
    return str(path)


def shakespeare_bert_data(d) -> tuple:
    """(``_text_sentence`` prefix, vocab.txt) of the bundled corpus with a WordPiece vocabulary trained on it, in
    folder ``d``."""
    from tokenizers import BertWordPieceTokenizer

    jsonl = _shakespeare_jsonl(d / "corpus.jsonl")
    with open(jsonl) as f:
        docs = [json.loads(line)["text"] for line in f]
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(docs, vocab_size=8000, min_frequency=2, special_tokens=SPECIAL, show_progress=False)
    vocab = tok.save_model(str(d), "shakespeare")[0]
    return _preprocess(jsonl, str(d / "shakespeare"), vocab), vocab


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    return shakespeare_bert_data(tmp_path_factory.mktemp("bert_shakespeare"))


def _argv(prefix: str, vocab: str, cache: str, iters: int, **overrides):
    opts = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
            "max-position-embeddings": 64, "micro-batch-size": 16, "global-batch-size": 16, "train-iters": iters,
            "lr": 2e-3, "min-lr": 2e-4, "lr-decay-style": "cosine", "lr-warmup-iters": 10, "weight-decay": 0.01,
            "clip-grad": 1.0, "seed": 1234, "log-interval": 25, "eval-iters": 4, "eval-interval": 1000,
            "split": "95,5,0", "tokenizer-type": "BertWordPieceLowerCase", "vocab-file": vocab,
            "data-path": prefix, "data-cache-path": cache, "num-workers": 0, "attention-backend": "unfused"}
    opts.update(overrides)
    argv = []
    for key, value in opts.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def _check_learns(summary, iters: int):
    hist = summary["history"]
    assert len(hist) == iters
    first = np.mean([h["lm loss"] for h in hist[:5]])
    last = np.mean([h["lm loss"] for h in hist[-10:]])
    assert last < 0.8 * first, (first, last)
    valid = summary["valid"]
    assert set(valid) == {"lm loss", "sop loss", "sop accuracy"} and valid["lm loss"] < 0.85 * first, valid
    return first, last


def test_shakespeare_with_a_trained_wordpiece_vocabulary(shakespeare, tmp_path, capsys):
    prefix, vocab = shakespeare
    summary = pretrain_bert.main(_argv(prefix, vocab, str(tmp_path / "cache"), 150, lr=5e-3, **{"min-lr": 5e-4}))
    _check_learns(summary, 150)
    out = capsys.readouterr().out
    assert "| lm loss: " in out and "| sop loss: " in out and "| sop accuracy: " in out
    assert "validation loss at iteration 150 | lm loss value:" in out


@pytest.mark.skipif(not os.path.exists(os.path.join(SHARED_DATA, "corpus", "prose.jsonl.gz")),
                    reason="needs ../shared/data (corpus/prose.jsonl.gz and bert/vocab.txt)")
def test_prose_corpus_with_bert_base_uncased_vocabulary(tmp_path):
    """Every 15th document of the prose corpus (Shakespeare, Brown, Wikipedia leads: ~1.8 MB of JSON)."""
    jsonl = tmp_path / "slice.jsonl"
    with gzip.open(os.path.join(SHARED_DATA, "corpus", "prose.jsonl.gz"), "rt") as fin, open(jsonl, "w") as fout:
        for i, line in enumerate(fin):
            if i % 15 == 0:
                fout.write(line)
    vocab = os.path.join(SHARED_DATA, "bert", "vocab.txt")
    prefix = _preprocess(str(jsonl), str(tmp_path / "prose"), vocab)
    summary = pretrain_bert.main(_argv(prefix, vocab, str(tmp_path / "cache"), 150,
                                       **{"hidden-size": 32, "seq-length": 32, "max-position-embeddings": 32}))
    _check_learns(summary, 150)


def test_gpt_document_data_is_one_error_line(shakespeare, tmp_path):
    _, vocab = shakespeare
    jsonl = _shakespeare_jsonl(tmp_path / "corpus.jsonl")
    prefix = _preprocess(jsonl, str(tmp_path / "gpt"), vocab, split_sentences=False)
    argv = _argv(prefix, vocab, str(tmp_path / "cache"), 2, **{"global-batch-size": 32, "lr-warmup-iters": 0})
    proc = run_pretrain(argv, nproc=2, timeout=300, expect_ok=False, script="pretrain_bert.py")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --data-path {prefix}: every document is a single sequence, so it was not split "
                      "into sentences; BERT needs data preprocessed with --split-sentences (a _text_sentence "
                      "prefix)"], proc.stderr[-3000:]
    # no traceback frame from this project's files (torchrun's own failure report is the launcher's)
    assert 'File "' + ROOT not in proc.stderr, proc.stderr[-3000:]
