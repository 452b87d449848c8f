"""The tokens every trainer of the throughput benchmarks trains on, read the same way by all of them.

On a GPU the time of a GEMM depends on the data it multiplies (the clock follows the power drawn), so a trainer
fed random or degenerate tokens is not comparable with one fed text. Every benchmark therefore uses the bundled
corpus (``data/tinyshakespeare.jsonl.gz``) tokenised once by ``tools/preprocess_data.py`` into a ``.bin/.idx``
pair. Our trainer reads it inside ``pretrain_gpt.py``; the peers read it through ``batches`` below, which parses
the very flags our trainer gets with the library's own parser, builds the same ``TrainingContext`` and asks
``pretrain_gpt.datasets_provider`` and the training loop's iterator builder for the training micro-batches at
data-parallel size 1. Iteration ``i`` of every trainer sees the same samples.
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


def data_flags(data_prefix: str) -> str:
    """The data flags every benchmark run of ``pretrain_gpt.py`` gets (``--mock-data`` for ``data_prefix=None``)."""
    source = "--mock-data" if data_prefix is None else f"--data-path {shlex.quote(data_prefix)}"
    return (f"{source} --split {SPLIT} --seed {SEED} --num-workers {NUM_WORKERS} --tokenizer-type GPT2BPETokenizer "
            f"--vocab-file {shlex.quote(VOCAB_FILE)} --merge-file {shlex.quote(MERGE_FILE)} "
            "--make-vocab-size-divisible-by 128")


def trainer_flags(data_prefix, num_layers: int, hidden_size: int, num_heads: int, seq_length: int,
                  micro_batch_size: int, iterations: int, global_batch_size: int = 0) -> list:
    """The shape, batch, iteration and data flags of a ``pretrain_gpt.py`` run (global batch: the micro-batch)."""
    return shlex.split(
        f"--num-layers {num_layers} --hidden-size {hidden_size} --num-attention-heads {num_heads} "
        f"--seq-length {seq_length} --max-position-embeddings {seq_length} "
        f"--micro-batch-size {micro_batch_size} --global-batch-size {global_batch_size or micro_batch_size} "
        f"--train-iters {iterations} {data_flags(data_prefix)}")


def trainer_context(argv: list):
    """The ``TrainingContext`` ``pretrain()`` builds for ``pretrain_gpt.py argv`` in one process (no model, no
    process group): the library's parser, validation and tokenizer."""
    from megatron.core.parallel_state import ParallelState
    from megatron.training.arguments import parse_config
    from megatron.training.setup import build_context

    cfg, _ = parse_config(argv, world_size=1)
    return build_context(cfg, ParallelState.single())


def batches(argv: list, num_workers: int = None):
    """An iterator of ``{"text": int64[micro_batch_size, seq_length + 1]}``: the training micro-batches that
    ``pretrain_gpt.py argv`` reads at data-parallel size 1, in order, from its first iteration on.

    The datasets come from ``pretrain_gpt.datasets_provider`` and the loader from the training loop's own builder,
    with the sample counts and loader settings ``pretrain()`` derives from ``argv``. ``num_workers`` (loader
    processes; ``None``: the ``--num-workers`` of ``argv``) changes how the batches are read, not which.
    """
    import dataclasses

    sys.path.insert(0, ROOT)
    import pretrain_gpt
    from megatron.training.setup import build_iterators

    ctx = trainer_context(argv)
    data = ctx.config.data
    if num_workers is not None:
        config = dataclasses.replace(ctx.config, data=dataclasses.replace(data, num_workers=num_workers))
        ctx = dataclasses.replace(ctx, config=config)
    return build_iterators(ctx, pretrain_gpt.datasets_provider, 0, 0, 1)["train"][0]


def prepare_bert_dataset(workdir: str, vocab_file: str, lower_case: bool = True, source: str = None) -> str:
    """The bundled corpus (or the loose-JSON ``source``, ``.jsonl`` or ``.jsonl.gz``) split into sentences and
    tokenised with the WordPiece ``vocab_file`` (``tools/preprocess_data.py --split-sentences``); returns the
    ``_text_sentence`` prefix."""
    prefix = os.path.join(workdir, "bench_bert_text_sentence")
    if os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx"):
        return prefix
    src = source or os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz")
    jsonl = os.path.join(workdir, "corpus.jsonl")
    with (gzip.open(src, "rb") if src.endswith(".gz") else open(src, "rb")) as fin, open(jsonl, "wb") as fout:
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
