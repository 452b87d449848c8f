"""The binary head's labels carry the sentence order of real text.

On the bundled corpus, split into sentences and tokenised with a WordPiece vocabulary trained here, a linear
bag-of-words classifier over ``count(token in segment A) - count(token in segment B)``, trained by Adam on fresh
batches of masked-LM samples as training reads them, predicts ``is_random`` well above chance. With the labels
shuffled against the samples it stays at chance, so the check fails if ``is_random`` stopped describing the swap
of A and B. (The tiny transformer's own sentence-order accuracy on real text is discussed in docs/bert.md.)
"""

import gzip
import json
import os

import numpy as np
import pytest
import torch

from megatron.core.datasets import BertDatasetConfig, IndexedDataset, IndexedDatasetBuilder, WordPieceVocab
from megatron.core.datasets.bert_dataset import BERTMaskedDataset
from megatron.core.datasets.indexed_dataset import optimal_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
DOCS, SEQ, STEPS, BATCH = 200, 64, 60, 64


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    """A BERT masked-LM dataset of the bundled corpus's first documents, and its vocabulary size."""
    tokenizers = pytest.importorskip("tokenizers")
    from megatron.core.datasets.sentence_splitter import SentenceSplitter

    with gzip.open(os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "rt") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(DOCS), f)]
    tok = tokenizers.BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(docs, vocab_size=2000, special_tokens=SPECIAL, show_progress=False)
    vocab = tok.get_vocab()
    splitter = SentenceSplitter()
    prefix = str(tmp_path_factory.mktemp("sop") / "corpus_text_sentence")
    builder = IndexedDatasetBuilder(prefix + ".bin", optimal_dtype(len(vocab)))
    for doc in docs:
        for sentence in splitter.split(doc):
            ids = tok.encode(sentence, add_special_tokens=False).ids
            if ids:
                builder.add_item(ids)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    indexed = IndexedDataset(prefix)
    config = BertDatasetConfig(seq_length=SEQ, seed=1234, vocab=WordPieceVocab.from_vocab(vocab))
    dataset = BERTMaskedDataset(indexed, np.arange(len(indexed.document_indices) - 1), STEPS * BATCH, config)
    return dataset, len(vocab)


def _features(dataset, vocab_size: int, idx: int):
    d = dataset[idx]
    real = d["padding_mask"] == 1
    tokens = np.where(d["loss_mask"] == 1, d["labels"], d["text"])[real]  # the unmasked text
    types = d["types"][real]
    x = np.zeros(vocab_size, dtype=np.float32)
    np.add.at(x, tokens[types == 0], 1.0)
    np.add.at(x, tokens[types == 1], -1.0)
    return x, d["is_random"]


def _online_accuracy(dataset, vocab_size: int, shuffle_labels: bool) -> float:
    """Accuracy over the last 20 of STEPS batches, each measured before the step that learns from it."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    w = torch.zeros(vocab_size, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=0.01)
    hits = []
    for step in range(STEPS):
        xs, ys = zip(*(_features(dataset, vocab_size, step * BATCH + j) for j in range(BATCH)))
        y = np.array(ys, dtype=np.float32)
        if shuffle_labels:
            y = rng.permutation(y)
        x, y = torch.from_numpy(np.stack(xs)), torch.from_numpy(y)  # [B, V], [B]
        logit = x @ w + b  # [B]
        hits.append(((logit > 0).float() == y).float().mean().item())
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(np.mean(hits[-20:]))


def test_segments_a_and_b_carry_the_is_random_label(samples):
    dataset, vocab_size = samples
    labels = [dataset[i]["is_random"] for i in range(STEPS * BATCH)]
    assert 0.4 < np.mean(labels) < 0.6
    learned = _online_accuracy(dataset, vocab_size, shuffle_labels=False)
    control = _online_accuracy(dataset, vocab_size, shuffle_labels=True)
    print(f"bag-of-words accuracy {learned:.3f}, with shuffled labels {control:.3f}")
    assert learned > 0.62, learned
    assert abs(control - 0.5) < 0.07, control
