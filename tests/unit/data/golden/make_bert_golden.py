"""Generate bert_golden.json with Megatron-Core's own BERTMaskedWordPieceDataset (NOT a project dependency).

Run from the repository root with the throw-away environment of make_golden.py:

    python -m venv /tmp/mcore
    /tmp/mcore/bin/pip install megatron-core==0.16.1 numpy torch==2.13.0
    /tmp/mcore/bin/python tests/unit/data/golden/make_bert_golden.py [--real PREFIX VOCAB]

It writes the synthetic sentence datasets of bert_golden_spec.py with Megatron-Core's IndexedDatasetBuilder,
builds the BERT splits of every configuration with BlendedMegatronDatasetBuilder, and records every split's
length, the sha256 of all its items (fields in a fixed order) and its first items field by field.
With ``--real PREFIX VOCAB`` it also records the binary-head configuration on a real ``_text_sentence``
dataset. The committed record was made from the first 120 documents of ../shared/data/corpus/prose.jsonl.gz
with the bert-base-uncased vocabulary, preprocessed by this project (the test checks the files' sha256):

    PYTHONPATH=$PWD python -c "import pathlib; from megatron.core.datasets import preprocessing as P; \
        from tests.unit.data.test_bert_dataset import _real_sentence_data; \
        _real_sentence_data(pathlib.Path('/tmp/real'), '../shared/data/corpus/prose.jsonl.gz', \
                            '../shared/data/bert/vocab.txt', P)"
    /tmp/mcore/bin/python tests/unit/data/golden/make_bert_golden.py \
        --real /tmp/real/prose_text_sentence ../shared/data/bert/vocab.txt
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile

import numpy
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bert_golden_spec import CONFIGS, SHOW, sentence_documents, vocab_tokens  # noqa: E402

FIELDS = ("text", "types", "labels", "loss_mask", "padding_mask")
REAL_CONFIG = dict(split="98,2,0", seq_length=128, seed=1234, sizes=[300, 20, 0], binary_head=True,
                   mask_prob=0.15, short_seq_prob=0.1, max_ngram=3, whole_word=True)


class _WordPieceTokenizer:
    """The attributes Megatron's BERT dataset reads from its WordPiece tokenizer."""

    def __init__(self, tokens):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.inv_vocab = {i: t for i, t in enumerate(tokens)}
        self.vocab_size = len(tokens)
        self.cls, self.sep, self.mask, self.pad = (self.vocab[t] for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
        self.eos = self.eod = self.vocab["[EOS]"]
        self.unique_identifiers = {"class": "WordPieceTokenizer", "size": len(tokens)}


def read_vocab(path):
    """Megatron's BERT vocabulary: ids are line numbers of vocab.txt, then [BOS] and [EOS]."""
    with open(path, encoding="utf-8") as f:
        tokens = [line.strip() for line in f]
    return tokens + [t for t in ("[BOS]", "[EOS]") if t not in tokens]


def sha(a):
    return hashlib.sha256(numpy.ascontiguousarray(a).tobytes()).hexdigest()


def file_sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_dataset(prefix, name, vocab_size):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for doc in sentence_documents(name):
        b.add_document(numpy.array([t for s in doc for t in s], dtype=numpy.int64), [len(s) for s in doc])
    b.finalize(prefix + ".idx")


def record(datasets, sizes):
    res = {}
    for i, (split, ds) in enumerate(zip(("train", "valid", "test"), datasets)):
        if ds is None or sizes[i] == 0:
            res[split] = None
            continue
        items = [ds[k] for k in range(len(ds))]
        flat = numpy.concatenate([numpy.concatenate([it[f] for f in FIELDS] +
                                                    [numpy.array([it["is_random"], it["truncated"]])])
                                  for it in items])
        res[split] = {
            "len": len(ds),
            "all_sha256": sha(flat.astype(numpy.int64)),
            "first": [{k: (v.tolist() if isinstance(v, numpy.ndarray) else int(v)) for k, v in it.items()}
                      for it in items[:SHOW]],
        }
    return res


def build(c, blend, tokenizer, cache):
    cfg = BERTMaskedWordPieceDatasetConfig(
        random_seed=c["seed"], sequence_length=c["seq_length"], blend=blend, split=c["split"],
        path_to_cache=cache, tokenizer=tokenizer, masking_probability=c["mask_prob"],
        short_sequence_probability=c["short_seq_prob"], masking_max_ngram=c["max_ngram"],
        masking_do_full_word=c["whole_word"], masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False, classification_head=c["binary_head"])
    return BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, list(c["sizes"]), lambda: True, cfg).build()


def main():
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--real", nargs=2, metavar=("PREFIX", "VOCAB"))
    a = ap.parse_args()
    torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), world_size=1, rank=0)
    tokens = vocab_tokens()
    tokenizer = _WordPieceTokenizer(tokens)
    out = {"megatron_core_version": "0.16.1", "vocab_size": len(tokens), "fields": list(FIELDS), "files": {},
           "configs": {}}
    tmp = tempfile.mkdtemp()
    prefixes = {}
    for name in ("S", "T"):
        p = os.path.join(tmp, name)
        write_dataset(p, name, len(tokens))
        prefixes[name] = p
        out["files"][name] = {"bin_sha256": file_sha(p + ".bin"), "idx_sha256": file_sha(p + ".idx")}
    for cname, c in CONFIGS.items():
        paths = [prefixes.get(x, x) for x in c["data_path"]]
        blend = (paths, None) if len(paths) == 1 else (paths[1::2], [float(w) for w in paths[0::2]])
        out["configs"][cname] = record(build(c, blend, tokenizer, os.path.join(tmp, "cache")), c["sizes"])
    if a.real:
        prefix, vocab = a.real
        real_tok = _WordPieceTokenizer(read_vocab(vocab))
        out["real"] = {"config": REAL_CONFIG, "vocab_size": real_tok.vocab_size,
                       "bin_sha256": file_sha(prefix + ".bin"), "idx_sha256": file_sha(prefix + ".idx"),
                       "splits": record(build(REAL_CONFIG, ([prefix], None), real_tok, os.path.join(tmp, "rc")),
                                        REAL_CONFIG["sizes"])}
    with open(os.path.join(HERE, "bert_golden.json"), "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
    print("wrote", os.path.join(HERE, "bert_golden.json"))


if __name__ == "__main__":
    main()
