"""The tokens every trainer of the throughput benchmarks trains on, read the same way by all of them.

On a GPU the time of a GEMM depends on the data it multiplies (the clock follows the power drawn), so a trainer
fed random or degenerate tokens is not comparable with one fed text. Every benchmark therefore uses the bundled
corpus (``data/tinyshakespeare.jsonl.gz``) tokenised once by ``tools/preprocess_data.py`` into a ``.bin/.idx``
pair, and every trainer reads it through the library's own GPT dataset and pretraining data loader with the
flags our trainer gets (``--split 100,0,0``, ``--seed 1234``, ``--num-workers 2``): our trainer inside
``pretrain_gpt.py``, the peers through ``batches`` below. Iteration ``i`` of every trainer sees the same samples.
"""

from __future__ import annotations

import gzip
import os
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB_FILE = os.path.join(ROOT, "data", "gpt2-vocab.json")
MERGE_FILE = os.path.join(ROOT, "data", "gpt2-merges.txt")
SPLIT = "100,0,0"
SEED = 1234
NUM_WORKERS = 2


def prepare_dataset(workdir: str) -> str:
    """Tokenise the bundled corpus with tools/preprocess_data.py into ``workdir``; return the .bin/.idx prefix."""
    prefix = os.path.join(workdir, "bench_text_document")
    if os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx"):
        return prefix
    src = os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz")
    jsonl = os.path.join(workdir, "corpus.jsonl")
    with gzip.open(src, "rb") as fin, open(jsonl, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
           "--output-prefix", os.path.join(workdir, "bench"), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE, "--append-eod", "--workers", "2"]
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    if not os.path.exists(prefix + ".bin"):
        raise RuntimeError(f"tools/preprocess_data.py did not write {prefix}.bin")
    return prefix


def batches(data_prefix: str, seq_length: int, micro_batch_size: int, iterations: int,
            num_workers: int = NUM_WORKERS):
    """An iterator of ``{"text": int64[micro_batch_size, seq_length + 1]}``: the micro-batches that
    ``pretrain_gpt.py`` reads in its first ``iterations`` iterations at data-parallel size 1 with the benchmark's
    ``--split``, ``--seed`` and ``--num-workers`` (its training sample count is ``iterations x micro-batch``)."""
    from megatron.core.datasets.builder import build_gpt_datasets
    from megatron.core.datasets.samplers import build_pretraining_data_loader

    if not (os.path.exists(data_prefix + ".bin") and os.path.exists(data_prefix + ".idx")):
        raise FileNotFoundError(f"--data-prefix {data_prefix}: expected {data_prefix}.bin and {data_prefix}.idx")
    train, _, _ = build_gpt_datasets([data_prefix], SPLIT, seq_length, SEED,
                                     (iterations * micro_batch_size, 0, 0))
    loader = build_pretraining_data_loader(train, 0, micro_batch_size, 0, 1, num_workers=num_workers)
    return iter(loader)


def prepare_bert_dataset(workdir: str, vocab_file: str, lower_case: bool = True) -> str:
    """The bundled corpus split into sentences and tokenised with the WordPiece ``vocab_file``
    (``tools/preprocess_data.py --split-sentences``); returns the ``_text_sentence`` prefix."""
    prefix = os.path.join(workdir, "bench_bert_text_sentence")
    if os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx"):
        return prefix
    src = os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz")
    jsonl = os.path.join(workdir, "corpus.jsonl")
    with gzip.open(src, "rb") as fin, open(jsonl, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    tokenizer = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
           "--output-prefix", os.path.join(workdir, "bench_bert"), "--tokenizer-type", tokenizer,
           "--vocab-file", vocab_file, "--split-sentences", "--workers", "2"]
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    if not os.path.exists(prefix + ".bin"):
        raise RuntimeError(f"tools/preprocess_data.py did not write {prefix}.bin")
    return prefix


def bert_batches(data_prefix: str, vocab_file: str, seq_length: int, micro_batch_size: int, iterations: int,
                 num_workers: int = NUM_WORKERS, lower_case: bool = True):
    """An iterator of BERT micro-batches (``text``, ``types``, ``labels``, ``is_random``, ``loss_mask``,
    ``padding_mask``, ...): those ``pretrain_bert.py`` reads in its first ``iterations`` iterations at
    data-parallel size 1 with the benchmark's ``--split``, ``--seed``, ``--num-workers`` and the default masking."""
    from megatron.core.datasets import BertDatasetConfig, WordPieceVocab, build_bert_datasets
    from megatron.core.datasets.samplers import build_pretraining_data_loader
    from megatron.core.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("BertWordPieceLowerCase" if lower_case else "BertWordPieceCase", vocab_file=vocab_file)
    config = BertDatasetConfig(seq_length=seq_length, seed=SEED,
                               vocab=WordPieceVocab.from_tokenizer(tokenizer, f"--vocab-file {vocab_file}"))
    train, _, _ = build_bert_datasets([data_prefix], SPLIT, config, (iterations * micro_batch_size, 0, 0))
    loader = build_pretraining_data_loader(train, 0, micro_batch_size, 0, 1, num_workers=num_workers)
    return iter(loader)
