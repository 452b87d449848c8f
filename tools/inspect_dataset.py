#!/usr/bin/env python
"""Show what a training run will see: build the train/valid/test splits as training does and print them.

GPT (default):

    python tools/inspect_dataset.py --data-path runs/data/quickstart_text_document --split 949,50,1 \\
        --seq-length 256 --seed 1234 --num-samples 1000 100 10 --show 2

prints each split's number of samples and its first K samples as decoded text (GPT-2 tokenizer from the
bundled data/ files unless --tokenizer-type/--vocab-file/--merge-file/--tokenizer-model say otherwise).

BERT (sentence-split data, pretrain_bert's flags; tokenizer BertWordPieceLowerCase unless --tokenizer-type):

    python tools/inspect_dataset.py --dataset-type bert --data-path runs/data/wiki_text_sentence \\
        --vocab-file bert-vocab.txt --seq-length 128 --num-samples 1000 100 10 --mask-prob 0.15 \\
        --short-seq-prob 0.1 [--bert-no-binary-head] [--no-whole-word-masking] [--masking-max-ngram 3]

With --json it prints one JSON object instead:
    GPT:  {"train": {"len": n, "samples": [[ids...], ...]}, "valid": {...}, "test": {...}}
          with seq_length + 1 ids per sample;
    BERT: {"train": {"len": n, "samples": [{"text": [...], "types": [...], "labels": [...], "is_random": 0,
          "padding_mask": [...], "loss_mask": [...], "truncated": 0}, ...]}, ...}
          with Megatron's field names and values (labels -1 where not masked).
A split that is not built has len 0 and no samples.
--data-path takes Megatron's forms: PREFIX, P1 P2 ..., or W1 P1 W2 P2 ...
"""

import argparse
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

from megatron.core.datasets import builder  # noqa: E402

BERT_FIELDS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset-type", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--data-path", nargs="+", required=True)
    p.add_argument("--split", default="949,50,1")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-samples", type=int, nargs=3, required=True, metavar=("TRAIN", "VALID", "TEST"))
    p.add_argument("--show", type=int, default=3, help="samples to print per split")
    p.add_argument("--json", action="store_true", help="print JSON (token ids) instead of text")
    p.add_argument("--data-cache-path", default=None, help="where index .npy files are cached (default: none)")
    p.add_argument("--tokenizer-type", default=None,
                   help="default GPT2BPETokenizer (gpt) or BertWordPieceLowerCase (bert)")
    p.add_argument("--vocab-file", default=None, help="default: the bundled GPT-2 vocab.json (gpt); required for bert")
    p.add_argument("--merge-file", default=None)
    p.add_argument("--tokenizer-model", default=None)
    bert = p.add_argument_group("BERT (--dataset-type bert)")
    bert.add_argument("--mask-prob", type=float, default=0.15)
    bert.add_argument("--short-seq-prob", type=float, default=0.1)
    bert.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head")
    bert.add_argument("--no-whole-word-masking", action="store_false", dest="whole_word_masking")
    bert.add_argument("--masking-max-ngram", type=int, default=3)
    a = p.parse_args(argv)
    if a.seq_length < 1:
        p.error(f"--seq-length must be >= 1, got {a.seq_length}")
    if a.show < 0:
        p.error(f"--show must be >= 0, got {a.show}")
    if a.dataset_type == "gpt":
        a.tokenizer_type = a.tokenizer_type or "GPT2BPETokenizer"
        if a.tokenizer_type == "GPT2BPETokenizer":
            a.vocab_file = a.vocab_file or os.path.join(ROOT, "data", "gpt2-vocab.json")
            a.merge_file = a.merge_file or os.path.join(ROOT, "data", "gpt2-merges.txt")
    else:
        a.tokenizer_type = a.tokenizer_type or "BertWordPieceLowerCase"
        if a.tokenizer_type.startswith("BertWordPiece") and not a.vocab_file:
            p.error("--dataset-type bert needs --vocab-file (the BERT vocab.txt the data was made with)")
    return a


def _tokenizer(a):
    from megatron.core.tokenizer import build_tokenizer

    return build_tokenizer(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model)


def _build(a, tok):
    if a.dataset_type == "gpt":
        return builder.build_gpt_datasets(a.data_path, a.split, a.seq_length, a.seed, a.num_samples,
                                          cache_dir=a.data_cache_path)
    from megatron.core.datasets import BertDatasetConfig, MaskingConfig, WordPieceVocab

    masking = MaskingConfig(mask_prob=a.mask_prob, max_ngram=a.masking_max_ngram, whole_word=a.whole_word_masking)
    config = BertDatasetConfig(seq_length=a.seq_length, seed=a.seed,
                               vocab=WordPieceVocab.from_tokenizer(tok, f"--vocab-file {a.vocab_file}"),
                               short_seq_prob=a.short_seq_prob, binary_head=a.bert_binary_head, masking=masking)
    return builder.build_bert_datasets(a.data_path, a.split, config, a.num_samples, cache_dir=a.data_cache_path)


def _sample(a, item):
    if a.dataset_type == "gpt":
        return item["text"].tolist()
    return {k: (item[k].tolist() if hasattr(item[k], "tolist") else item[k]) for k in BERT_FIELDS}


def _print_text(a, tok, report):
    for name, r in report.items():
        size = a.seq_length + (1 if a.dataset_type == "gpt" else 0)
        print(f"=== {name}: {r['len']} samples of {size} tokens")
        for i, s in enumerate(r["samples"]):
            if a.dataset_type == "gpt":
                print(f"--- {name}[{i}]")
                print(tok.detokenize(s))
                continue
            n = sum(s["padding_mask"])
            masked = [f"{p}:{tok.detokenize([s['labels'][p]])}" for p in range(n) if s["loss_mask"][p]]
            print(f"--- {name}[{i}] is_random={s['is_random']} truncated={s['truncated']} tokens={n}")
            print(tok.detokenize(s["text"][:n]))
            print("masked (position:original):", " ".join(masked))


def main(argv=None) -> int:
    a = get_args(argv)
    try:
        tok = None if (a.dataset_type == "gpt" and a.json) else _tokenizer(a)
        splits = _build(a, tok)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    report = {}
    for name, ds in zip(("train", "valid", "test"), splits):
        n = 0 if ds is None else len(ds)
        samples = [] if ds is None else [_sample(a, ds[i]) for i in range(min(a.show, n))]
        report[name] = {"len": n, "samples": samples}
    if a.json:
        print(json.dumps(report))
    else:
        _print_text(a, tok, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
