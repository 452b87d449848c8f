"""Loose JSON -> ``.bin``/``.idx``: the engine behind ``tools/preprocess_data.py``.

With several workers and one uncompressed input file, the file is cut into byte ranges that start at
line starts; each worker reads its own ranges (no reader process in between, no per-line transfers),
parses the JSON, optionally splits sentences, tokenizes a few MB at a time in one call of the tokenizer
and returns the range's tokens and lengths as NumPy arrays; the main process only appends them, in
range order (hence Megatron's document order), to one ``IndexedDatasetBuilder`` per JSON key and writes
the ``.idx``. Otherwise (``.gz``, several files, ``--partitions``, one worker) the main process streams
batches of lines to the workers and appends their results in input order. Either way memory stays
bounded by a few ranges or batches in flight.

The documents and sequences written are those Megatron-LM's ``preprocess_data.py`` writes for the same
input and flags: one sequence per document (one per non-empty sentence with ``--split-sentences``), the
EOD id appended to the last sequence of every non-empty document with ``--append-eod``, a document with
no tokens kept as an empty document, uint16 ids below 65,500 vocabulary entries else int32, and with
``--partitions P`` the documents ordered as Megatron's round-robin partitions merged in order.

Unlike Megatron-LM, bad lines (malformed JSON, not an object, a missing key, a value that is not a
string or a list of strings, invalid Unicode) are reported with their line numbers, counted and skipped;
``--strict`` makes the first one fatal. On any failure the partial output is removed.
"""

from __future__ import annotations

import gzip
import io
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, optimal_dtype

BATCH_BYTES = 1 << 20  # lines handed to a worker at a time (about 1 MB of JSON)
RANGE_BYTES = 64 << 20  # at most this much of the input file per worker task in the byte-range mode
CHUNK_BYTES = 1 << 20  # lines a worker reads and tokenizes at a time within its range
MAX_REPORTED = 20  # bad lines printed one by one; the rest are only counted


@dataclass
class PreprocessConfig:
    """What ``tools/preprocess_data.py`` was asked to do (Megatron's flags)."""

    input: str
    output_prefix: str
    tokenizer_type: str
    json_keys: Sequence[str] = ("text",)
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    workers: int = 1
    partitions: int = 1
    keep_sequential_samples: bool = False
    log_interval: int = 1000
    strict: bool = False
    quiet: bool = False
    vocab_size: Optional[int] = None  # NullTokenizer's --vocab-size

    def output_names(self) -> Dict[str, str]:
        """``{key: PREFIX_{key}_{document|sentence}}`` for every JSON key."""
        level = "sentence" if self.split_sentences else "document"
        return {k: f"{self.output_prefix}_{k}_{level}" for k in self.json_keys}


@dataclass
class BadLine:
    line: int  # 1-based line number in the (concatenated) input
    reason: str


@dataclass
class Stats:
    documents: int = 0
    tokens: int = 0
    json_bytes: int = 0
    blank_lines: int = 0
    bad: List[BadLine] = field(default_factory=list)
    bad_count: int = 0
    seconds: float = 0.0


class BadInputError(ValueError):
    """Raised under ``--strict`` for the first bad input line."""


# ----------------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------------

_WORKER: Dict[str, object] = {}


def _init_worker(cfg: PreprocessConfig, tok=None) -> None:
    from megatron.core.tokenizer import build_tokenizer

    _WORKER.clear()  # nothing of an earlier run in this process (or in its parent) may leak into this one
    _WORKER["cfg"] = cfg
    _WORKER["tok"] = tok if tok is not None else \
        build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model, cfg.vocab_size)
    if cfg.split_sentences:
        from megatron.core.datasets.sentence_splitter import SentenceSplitter

        _WORKER["splitter"] = SentenceSplitter(cfg.lang, keep_newlines=cfg.keep_newlines)


def _warm_up(tok) -> None:
    """Build lazily created tokenizer state (GPT-2's encoder and character classes) before forking."""
    if hasattr(tok, "prepare_bulk"):
        tok.prepare_bulk(CHUNK_BYTES + (CHUNK_BYTES >> 3))  # characters of a chunk (at most its bytes) and more


def _describe(value) -> str:
    return type(value).__name__ if value is not None else "null"


def _parse(lines: List[bytes], first_line: int, keys: Sequence[str]):
    """Parse JSON lines -> (texts per key per document, bad lines, blank count, bytes of good lines)."""
    docs = []  # (line number, [value per key]); a value is a string or a list of strings
    bad: List[BadLine] = []
    blank = 0
    for i, raw in enumerate(lines):
        lineno = first_line + i
        if not raw.strip():
            blank += 1
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            bad.append(BadLine(lineno, f"malformed JSON ({err})"))
            continue
        if not isinstance(obj, dict):
            bad.append(BadLine(lineno, f"expected a JSON object, got {_describe(obj)}"))
            continue
        per_key = []
        for key in keys:
            if key not in obj:
                per_key = f"missing key {key!r}"
                break
            v = obj[key]
            if isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
                per_key.append(v)  # a string, or a list of strings: the document's sentences
            else:
                per_key = f"key {key!r} is {_describe(v)}, not a string"
                break
        if isinstance(per_key, str):
            bad.append(BadLine(lineno, per_key))
            continue
        docs.append((lineno, per_key))
    return docs, bad, blank


def _valid_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def encode_batch(job: Tuple[int, List[bytes]]):
    """Worker entry: one batch of raw lines -> per-key arrays ready for ``add_documents``."""
    first_line, lines = job
    cfg: PreprocessConfig = _WORKER["cfg"]  # type: ignore[assignment]
    tok = _WORKER["tok"]
    splitter = _WORKER.get("splitter")
    docs, bad, blank = _parse(lines, first_line, cfg.json_keys)

    # Strings become one sequence, or their sentences with --split-sentences; a list is already split.
    def sequences(v):
        if isinstance(v, list):
            return v
        return splitter.split(v) if splitter is not None else [v]

    docs = [(ln, [sequences(v) for v in per_key]) for ln, per_key in docs]
    # Lone surrogates (possible through JSON escapes) cannot be tokenized: report the line.
    good = []
    for ln, per_key in docs:
        if all(t.isascii() or _valid_unicode(t) for texts in per_key for t in texts):  # isascii: O(1)
            good.append((ln, per_key))
        else:
            bad.append(BadLine(ln, "text is not valid Unicode (lone surrogate escape)"))
    bad.sort(key=lambda b: b.line)
    docs = good

    dtype = optimal_dtype(tok.vocab_size)
    out = {}
    ntokens = 0
    for k, key in enumerate(cfg.json_keys):
        strings = [t for _, per_key in docs for t in per_key[k]]
        ids, lens = tok.tokenize_batch_flat(strings) if hasattr(tok, "tokenize_batch_flat") \
            else _flatten(tok.tokenize_batch(strings))
        lens = np.asarray(lens, dtype=np.int64)
        counts = np.array([len(per_key[k]) for _, per_key in docs], dtype=np.int64)
        tokens, seq_lens, seqs_per_doc = _assemble(np.asarray(ids), lens, counts, tok.eod, cfg.append_eod)
        out[key] = (tokens.astype(dtype, copy=False), seq_lens, seqs_per_doc)
        ntokens += int(tokens.size)
    nbytes = sum(len(x) for x in lines)
    doc_lines = np.array([ln for ln, _ in docs], dtype=np.int64)
    return out, doc_lines, bad, blank, ntokens, nbytes


def _read_lines(path: str, start: int, end: int) -> Iterator[List[bytes]]:
    """Lines of ``path[start:end]`` (``start`` and ``end`` are line starts), about ``CHUNK_BYTES`` at a time."""
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            buf = f.read(min(CHUNK_BYTES, left))
            if not buf:
                break
            left -= len(buf)
            if left > 0 and not buf.endswith(b"\n"):
                rest = f.readline()  # finish the last line (it ends at or before ``end``)
                left -= len(rest)
                buf += rest
            lines = buf.split(b"\n")
            if lines[-1] == b"":
                lines.pop()
            yield lines


def encode_range(task: Tuple[str, int, int]):
    """Worker entry of the byte-range mode: tokenize the lines of ``path[start:end]``.

    Returns ``({key: (tokens, seq_lens, seqs_per_doc)}, documents, bad lines (numbered from 1 within the
    range), blank lines, tokens, bytes, lines)``; under ``--strict`` it stops at the first bad chunk.
    """
    path, start, end = task
    cfg: PreprocessConfig = _WORKER["cfg"]  # type: ignore[assignment]
    parts: Dict[str, List[Tuple[np.ndarray, np.ndarray, np.ndarray]]] = {k: [] for k in cfg.json_keys}
    bad: List[BadLine] = []
    blank = ntokens = nbytes = ndocs = 0
    line = 1
    for lines in _read_lines(path, start, end):
        out, doc_lines, b, bl, nt, nb = encode_batch((line, lines))
        for key, arrays in out.items():
            parts[key].append(arrays)
        bad += b
        blank, ntokens, ndocs = blank + bl, ntokens + nt, ndocs + len(doc_lines)
        nbytes += nb + len(lines)  # the newlines split off
        line += len(lines)
        if b and cfg.strict:
            break
    dtypes = (optimal_dtype(_WORKER["tok"].vocab_size), np.int32, np.int64)  # tokens, seq_lens, seqs_per_doc
    joined = {key: tuple(np.concatenate([c[i] for c in chunks]) if chunks else np.zeros(0, dt)
                         for i, dt in enumerate(dtypes)) for key, chunks in parts.items()}
    return joined, ndocs, bad, blank, ntokens, nbytes, line - 1


def _flatten(lists: List[List[int]]):
    lens = [len(x) for x in lists]
    flat = np.fromiter((i for x in lists for i in x), dtype=np.int64, count=sum(lens))
    return flat, lens


def _assemble(ids: np.ndarray, lens: np.ndarray, strings_per_doc: np.ndarray, eod: int, append_eod: bool):
    """Drop empty sentences, append EOD to each non-empty document -> (tokens, seq lengths, seqs per doc)."""
    doc_of_string = np.repeat(np.arange(len(strings_per_doc)), strings_per_doc)  # [n_strings]
    keep = lens > 0
    seq_lens = lens[keep]
    seq_doc = doc_of_string[keep]
    seqs_per_doc = np.bincount(seq_doc, minlength=len(strings_per_doc)).astype(np.int64)
    if not append_eod or seq_lens.size == 0:
        return ids, seq_lens.astype(np.int32), seqs_per_doc
    # The last kept sequence of each non-empty document gets one more token: EOD, inserted after it.
    last_seq = np.cumsum(seqs_per_doc)[seqs_per_doc > 0] - 1  # index into seq_lens
    ends = np.cumsum(seq_lens)[last_seq]  # insertion points in ids
    tokens = np.insert(ids.astype(np.int64, copy=False), ends, eod)
    seq_lens = seq_lens.copy()
    seq_lens[last_seq] += 1
    return tokens, seq_lens.astype(np.int32), seqs_per_doc


# ----------------------------------------------------------------------------------------------------
# main side
# ----------------------------------------------------------------------------------------------------


def _input_files(pattern: str) -> List[str]:
    if os.path.isfile(pattern):
        return [pattern]
    import glob

    files = sorted(glob.glob(pattern))
    if not files:
        raise ValueError(f"--input {pattern!r}: no such file (nor any file matching it as a glob)")
    return files


def _line_ranges(path: str, workers: int) -> List[Tuple[str, int, int]]:
    """Cut ``path`` into byte ranges starting at line starts: at least two per worker (so a fast worker
    takes over more), at most ``RANGE_BYTES`` each."""
    size = os.path.getsize(path)
    n = max(2 * workers, -(-size // RANGE_BYTES))
    bounds = [0]
    with open(path, "rb") as f:
        for k in range(1, n):
            pos = k * size // n
            if pos <= bounds[-1]:
                continue
            f.seek(pos - 1)
            f.readline()  # to the start of the next line (pos itself when byte pos-1 ends a line)
            if bounds[-1] < f.tell() < size:
                bounds.append(f.tell())
    bounds.append(size)
    return [(path, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


class _Reader:
    """Streams batches of raw lines from the input files; knows how far it got for the ETA."""

    def __init__(self, files: List[str]):
        self.files = files
        self.total_size = sum(os.path.getsize(f) for f in files)
        self._done_size = 0
        self._raw = None

    def seek_done(self, offset: int) -> None:
        """Byte-range mode (one file, read by the workers): everything before ``offset`` is done."""
        self._done_size = offset

    def position(self) -> int:
        return self._done_size + (self._raw.tell() if self._raw is not None and not self._raw.closed else 0)

    def batches(self) -> Iterator[Tuple[int, List[bytes]]]:
        line = 1
        for path in self.files:
            self._raw = open(path, "rb")
            stream = gzip.GzipFile(fileobj=self._raw) if path.endswith(".gz") else self._raw
            reader = io.BufferedReader(stream, 1 << 20) if path.endswith(".gz") else stream
            try:
                while True:
                    lines = reader.readlines(BATCH_BYTES)
                    if not lines:
                        break
                    yield line, lines
                    line += len(lines)
            except (OSError, EOFError) as err:
                raise ValueError(f"--input {path}: cannot read it ({err})") from err
            finally:
                self._done_size += os.path.getsize(path)
                self._raw.close()


def _bounded_imap(pool, fn, items, in_flight: int):
    """Ordered ``pool.imap`` that keeps at most ``in_flight`` items submitted (bounded memory:
    ``Pool.imap`` would read the whole input ahead)."""
    import collections

    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _range_results(results, reader: "_Reader", ranges):
    """Adapt ``encode_range`` results to ``encode_batch``'s shape: bad lines renumbered within the file,
    per-document line numbers (only counted here), and the reader's position moved for the ETA."""
    line_base = 0
    for (out, ndocs, bad, blank, ntokens, nbytes, nlines), (_, _, end) in zip(results, ranges):
        for b in bad:
            b.line += line_base
        line_base += nlines
        reader.seek_done(end)
        yield out, np.zeros(ndocs, dtype=np.int64), bad, blank, ntokens, nbytes


def _print(cfg: PreprocessConfig, msg: str) -> None:
    if not cfg.quiet:
        print(msg, file=sys.stderr, flush=True)


def _validate(cfg: PreprocessConfig) -> None:
    if cfg.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.partitions < 1:
        raise ValueError(f"--partitions must be >= 1, got {cfg.partitions}")
    if cfg.log_interval < 1:
        raise ValueError(f"--log-interval must be >= 1, got {cfg.log_interval}")
    if not cfg.json_keys:
        raise ValueError("--json-keys needs at least one key")
    if cfg.keep_newlines and not cfg.split_sentences:
        raise ValueError("--keep-newlines only applies with --split-sentences")
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output-prefix {cfg.output_prefix!r}: directory {out_dir} does not exist")


def preprocess(cfg: PreprocessConfig) -> Stats:
    """Run the whole conversion; returns counts. Raises ``BadInputError`` (``--strict``) or ``ValueError``."""
    from megatron.core.tokenizer import build_tokenizer

    _validate(cfg)
    files = _input_files(cfg.input)
    tok = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model, cfg.vocab_size)
    dtype = optimal_dtype(tok.vocab_size)
    names = cfg.output_names()
    parts = cfg.partitions if not cfg.keep_sequential_samples else 1  # sequential partitions keep the order
    part_prefix = {(k, p): (names[k] if parts == 1 else f"{names[k]}.partition{p}") for k in names for p in range(parts)}
    builders = {kp: IndexedDatasetBuilder(pre + ".bin", dtype) for kp, pre in part_prefix.items()}
    stats = Stats()
    reader = _Reader(files)
    pool = None
    t0 = time.time()
    try:
        fork = cfg.workers > 1 and sys.platform.startswith("linux")
        if fork:
            # Build the tokenizer (and its caches) once here; forked workers inherit it. Each worker is
            # one process on one core: the tokenizer library's own thread pool would only oversubscribe.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            _init_worker(cfg, tok)
            _warm_up(tok)
            pool = multiprocessing.get_context("fork").Pool(cfg.workers)
        if fork and parts == 1 and len(files) == 1 and not files[0].endswith(".gz"):
            # Byte-range mode: the workers read the file themselves; results come back in range order.
            ranges = _line_ranges(files[0], cfg.workers)
            results = _range_results(_bounded_imap(pool, encode_range, ranges, 2 * cfg.workers), reader, ranges)
        elif fork:
            results = _bounded_imap(pool, encode_batch, reader.batches(), 2 * cfg.workers)
        elif cfg.workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(cfg.workers, initializer=_init_worker, initargs=(cfg,))
            results = _bounded_imap(pool, encode_batch, reader.batches(), 2 * cfg.workers)
        else:
            _init_worker(cfg, tok)
            results = map(encode_batch, reader.batches())
        next_log = cfg.log_interval
        for out, doc_lines, bad, blank, ntokens, nbytes in results:
            _report_bad(cfg, stats, bad)
            if parts == 1:
                for key, (tokens, seq_lens, seqs_per_doc) in out.items():
                    builders[(key, 0)].add_documents(tokens, seq_lens, seqs_per_doc)
            else:
                _add_partitioned(builders, out, doc_lines, parts)
            ndocs = len(doc_lines)
            stats.documents += ndocs
            stats.tokens += ntokens
            stats.json_bytes += nbytes
            stats.blank_lines += blank
            if stats.documents >= next_log:
                _progress(cfg, stats, reader, t0)
                next_log = (stats.documents // cfg.log_interval + 1) * cfg.log_interval
        if parts > 1:
            _merge_partitions(builders, part_prefix, names, dtype, parts)
        else:
            for (key, _), b in builders.items():
                b.finalize(names[key] + ".idx")
    except BaseException:
        if pool is not None:
            pool.terminate()
            pool.join()
            pool = None
        for b in builders.values():
            b.abort()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    stats.seconds = time.time() - t0
    _print(cfg, _summary(stats, names))
    return stats


def _report_bad(cfg: PreprocessConfig, stats: Stats, bad: List[BadLine]) -> None:
    for b in bad:
        stats.bad_count += 1
        if cfg.strict:
            raise BadInputError(f"{cfg.input}: line {b.line}: {b.reason} (--strict: stopping; no output written)")
        if len(stats.bad) < MAX_REPORTED:
            stats.bad.append(b)
            _print(cfg, f"warning: {cfg.input}: line {b.line}: {b.reason}; skipped")
        elif stats.bad_count == MAX_REPORTED + 1:
            _print(cfg, "warning: more bad lines; only counting them from now on")


def _add_partitioned(builders, out, doc_lines: np.ndarray, parts: int) -> None:
    """Deal documents to partitions round-robin by input line (Megatron-LM's partition files)."""
    part = (doc_lines - 1) % parts  # [docs]
    for key, (tokens, seq_lens, seqs_per_doc) in out.items():
        seq_doc = np.repeat(np.arange(len(seqs_per_doc)), seqs_per_doc)  # [seqs]
        tok_seq = np.repeat(np.arange(len(seq_lens)), seq_lens)  # [tokens]
        for p in range(parts):
            dmask = part == p
            smask = dmask[seq_doc]
            builders[(key, p)].add_documents(tokens[smask[tok_seq]], seq_lens[smask], seqs_per_doc[dmask])


def _merge_partitions(builders, part_prefix, names, dtype, parts: int) -> None:
    """Finalize the partition files, merge them in order into the outputs, and delete them."""
    for (key, p), b in builders.items():
        b.finalize(part_prefix[(key, p)] + ".idx")
    for key, final in names.items():
        merged = IndexedDatasetBuilder(final + ".bin", dtype)
        try:
            for p in range(parts):
                merged.add_index(part_prefix[(key, p)])
            merged.finalize(final + ".idx")
        except BaseException:
            merged.abort()
            raise
        finally:
            for p in range(parts):
                for ext in (".bin", ".idx"):
                    if os.path.exists(part_prefix[(key, p)] + ext):
                        os.remove(part_prefix[(key, p)] + ext)


def _progress(cfg: PreprocessConfig, stats: Stats, reader: _Reader, t0: float) -> None:
    el = max(time.time() - t0, 1e-9)
    mbs = stats.json_bytes / el / 1e6
    msg = (f"processed {stats.documents} documents ({stats.documents / el:.0f} docs/s, {mbs:.2f} MB/s), "
           f"{stats.tokens} tokens")
    pos = reader.position()
    if reader.total_size and pos:
        frac = min(pos / reader.total_size, 1.0)
        msg += f", {100 * frac:.1f}% of input, ETA {el * (1 - frac) / max(frac, 1e-9):.0f} s"
    _print(cfg, msg)


def _summary(stats: Stats, names: Dict[str, str]) -> str:
    el = max(stats.seconds, 1e-9)
    lines = [f"done: {stats.documents} documents, {stats.tokens} tokens, {stats.json_bytes / 1e6:.1f} MB of JSON "
             f"in {el:.1f} s ({stats.documents / el:.0f} docs/s, {stats.json_bytes / el / 1e6:.2f} MB/s)"]
    if stats.bad_count:
        lines.append(f"skipped {stats.bad_count} bad line(s)")
    if stats.blank_lines:
        lines.append(f"ignored {stats.blank_lines} blank line(s)")
    for pre in names.values():
        lines.append(f"wrote {pre}.bin and {pre}.idx")
    return "\n".join(lines)
