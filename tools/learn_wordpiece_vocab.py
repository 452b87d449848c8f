#!/usr/bin/env python
"""Learn a BERT WordPiece vocabulary (``vocab.txt``) from a loose-JSON corpus, the same on every run.

    python tools/learn_wordpiece_vocab.py --input data/tinyshakespeare.jsonl.gz --vocab-size 8000 \\
        --min-frequency 2 --output runs/data/bert-vocab.txt

Text is normalized and split into words as BERT's lower-cased tokenizer does (Hugging Face ``tokenizers``'
``BertNormalizer`` and ``BertPreTokenizer``). The vocabulary starts from the special tokens and every character
(``c`` at the start of a word, ``##c`` inside one) and grows by merging the most frequent adjacent pair of pieces
(at least ``--min-frequency`` times) until it holds ``--vocab-size`` entries; a tie goes to the pair whose pieces
sort first. This is the algorithm of ``tokenizers``' WordPiece trainer, whose result varies from run to run: it
breaks ties in the order of a randomly seeded hash table.
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
import os
import sys
from collections import Counter, defaultdict
from typing import Dict, Iterable, List, Sequence, Tuple

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PREFIX = "##"


def count_words(texts: Iterable[str], lowercase: bool = True) -> Counter:
    """How often each word occurs, after BERT's normalization and pre-tokenization."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    normalizer = BertNormalizer(lowercase=lowercase)
    pre = BertPreTokenizer()
    counts: Counter = Counter()
    for text in texts:
        counts.update(word for word, _ in pre.pre_tokenize_str(normalizer.normalize_str(text)))
    return counts


def _join(left: str, right: str) -> str:
    return left + (right[len(PREFIX):] if right.startswith(PREFIX) else right)


def learn_vocab(word_counts: Dict[str, int], vocab_size: int, min_frequency: int = 2,
                special_tokens: Sequence[str] = SPECIAL_TOKENS) -> List[str]:
    """The vocabulary, in id order: special tokens, characters (sorted), then merged pieces in merge order."""
    words = sorted(word_counts)  # a fixed order, whatever the order the counts were made in
    freqs = [word_counts[w] for w in words]
    alphabet = sorted({c for w in words for c in w[:1]} | {PREFIX + c for w in words for c in w[1:]})
    vocab = list(dict.fromkeys([*special_tokens, *alphabet]))
    known = set(vocab)
    pieces: List[List[str]] = [[w[0]] + [PREFIX + c for c in w[1:]] for w in words]
    pair_counts: Dict[Tuple[str, str], int] = defaultdict(int)
    where: Dict[Tuple[str, str], set] = defaultdict(set)  # pair -> indices of the words holding it
    for i, (p, f) in enumerate(zip(pieces, freqs)):
        for pair in zip(p, p[1:]):
            pair_counts[pair] += f
            where[pair].add(i)
    heap = [(-n, pair) for pair, n in pair_counts.items()]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg:
            continue  # a stale entry: the pair's count changed since it was pushed
        if -neg < min_frequency:
            break
        merged = _join(*pair)
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
        changed = {}
        for i in where.pop(pair, ()):
            p, f = pieces[i], freqs[i]
            out, k = [], 0
            while k < len(p):
                if k + 1 < len(p) and (p[k], p[k + 1]) == pair:
                    out.append(merged)
                    k += 2
                else:
                    out.append(p[k])
                    k += 1
            pieces[i] = out
            delta = Counter(zip(out, out[1:]))
            delta.subtract(zip(p, p[1:]))
            for other, d in delta.items():
                if d:
                    pair_counts[other] += d * f
                    changed[other] = True
                    if d > 0:
                        where[other].add(i)
                    elif other not in zip(out, out[1:]):
                        where[other].discard(i)
        pair_counts.pop(pair, None)
        for other in changed:  # the heap orders by (count, pair): the push order does not matter
            n = pair_counts.get(other, 0)
            if n > 0 and other != pair:
                heapq.heappush(heap, (-n, other))
    return vocab


def read_texts(path: str, keys: Sequence[str]) -> List[str]:
    opener = gzip.open if path.endswith(".gz") else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--input {path}: line {n} is not JSON ({exc.msg})") from None
            for key in keys:
                if not isinstance(row, dict) or not isinstance(row.get(key), str):
                    raise ValueError(f"--input {path}: line {n} has no string {key!r}")
                texts.append(row[key])
    return texts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="loose JSON file, one object per line (.gz allowed)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is read")
    p.add_argument("--vocab-size", type=int, default=30522, help="entries of the vocabulary, at most")
    p.add_argument("--min-frequency", type=int, default=2, help="the least count of a pair that is merged")
    p.add_argument("--cased", action="store_true", help="keep case and accents (default: lower-case)")
    p.add_argument("--output", required=True, help="the vocab.txt to write")
    args = p.parse_args(argv)
    if args.vocab_size < len(SPECIAL_TOKENS) + 1:
        p.error(f"--vocab-size must be > {len(SPECIAL_TOKENS)}, got {args.vocab_size}")
    if args.min_frequency < 1:
        p.error(f"--min-frequency must be >= 1, got {args.min_frequency}")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: no such file")
    try:
        vocab = learn_vocab(count_words(read_texts(args.input, args.json_keys), lowercase=not args.cased),
                            args.vocab_size, args.min_frequency)
    except (ValueError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tmp = f"{args.output}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(token + "\n" for token in vocab))
    os.replace(tmp, args.output)
    print(f"> {len(vocab)} entries written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
