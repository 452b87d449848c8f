"""BERT masked-LM dataset over sentence-split ``.bin/.idx`` data, sample for sample as Megatron-Core builds it.

The sample map (``bert_samples.py``) says which sentences of one document form sample ``i`` and its target
length. Item ``i`` draws from ``numpy.random.RandomState((seed + i) % 2**32)``:

1. **Segments.** With the binary head the sentences are cut in two at a pivot (1 for two sentences, else
   ``randint(1, count)``) and, with probability 0.5 (``random() < 0.5``), A and B are swapped: the
   "random next" case (``is_random`` 1). Without the binary head all sentences form A and B is empty.
2. **Truncation.** While A and B together exceed the target length, one token is dropped from the longer
   of the two (B on a tie), from its front or its back with probability 0.5 each.
3. ``[CLS] A [SEP] B [SEP]`` (``[CLS] A [SEP]`` without B), token types 0 up to the first [SEP], 1 after.
4. **Masking** (``masking.py``) with the same generator.
5. **Padding** to ``seq_length`` with the [PAD] id.

Fields (all int64 arrays of ``seq_length`` unless said): ``text`` (tokens, [PAD] written as 0), ``types``,
``labels`` (the original token at masked positions, -1 elsewhere; a [PAD] label written as 0),
``loss_mask`` (1 at masked positions), ``padding_mask`` (1 on real tokens, the [PAD] id on padding),
``is_random`` (int) and ``truncated`` (int).

The sample map is cached like the GPT indices (``index_cache.py``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from megatron.core.datasets.bert_samples import build_sample_map
from megatron.core.datasets.index_cache import IndexCache, description_hash
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masking import MaskingConfig, mask_tokens

logger = logging.getLogger(__name__)

_INDEX_FORMAT = "megatron-lite-bert-v1"
MIN_SEQ_LENGTH = 5  # [CLS] a [SEP] b [SEP]


@dataclass(frozen=True)
class WordPieceVocab:
    """What the dataset needs from a WordPiece tokenizer: special ids, continuations, the replacement pool."""

    cls: int
    sep: int
    mask: int
    pad: int
    continuation: np.ndarray  # bool[vocab]: the token is spelled "##..."
    lookup: np.ndarray  # every id, ascending: the pool of random replacements

    @classmethod
    def from_tokenizer(cls, tokenizer, source: str = "--vocab-file") -> "WordPieceVocab":
        """From a tokenizer with a ``vocab`` mapping token -> id (e.g. ``BertWordPieceLowerCase``)."""
        return cls.from_vocab(dict(tokenizer.vocab), source)

    @classmethod
    def from_vocab(cls, vocab: Dict[str, int], source: str = "--vocab-file") -> "WordPieceVocab":
        missing = [t for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]") if t not in vocab]
        if missing:
            raise ValueError(f"{source}: the vocabulary lacks {', '.join(missing)}, which BERT samples need")
        ids = np.array(sorted(vocab.values()), dtype=np.int64)
        continuation = np.zeros(int(ids[-1]) + 1, dtype=bool)
        for token, i in vocab.items():
            if token.startswith("##"):
                continuation[i] = True
        return cls(vocab["[CLS]"], vocab["[SEP]"], vocab["[MASK]"], vocab["[PAD]"], continuation, ids)


@dataclass(frozen=True)
class BertDatasetConfig:
    """pretrain_bert's data settings; ``masking`` holds the ones Megatron fixes in code (n-grams, whole words)."""

    seq_length: int
    seed: int
    vocab: WordPieceVocab
    short_seq_prob: float = 0.1
    binary_head: bool = True
    masking: MaskingConfig = MaskingConfig()

    def __post_init__(self):
        if self.seq_length < MIN_SEQ_LENGTH:
            raise ValueError(f"--seq-length {self.seq_length} is too short for a BERT sample "
                             f"[CLS] A [SEP] B [SEP]: at least {MIN_SEQ_LENGTH} tokens are needed")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")


def check_sentence_data(indexed: IndexedDataset) -> None:
    """Refuse data with one sequence per document (``_text_document``): BERT needs sentences."""
    documents = len(indexed.document_indices) - 1
    if documents > 0 and len(indexed) <= documents:
        raise ValueError(f"--data-path {indexed.path_prefix}: every document is a single sequence, so it was not "
                         f"split into sentences; BERT needs data preprocessed with --split-sentences "
                         f"(a _text_sentence prefix)")


class BERTMaskedDataset:
    """Masked-LM samples from the documents ``documents`` of ``indexed`` (see module doc).

    ``num_samples`` None builds one epoch; otherwise whole epochs until at least that many samples.
    ``cache_dir``/``build`` as for ``GPTDataset``.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: Optional[int],
                 config: BertDatasetConfig, split: str = "train", cache_dir: Optional[str] = None,
                 build: bool = True):
        check_sentence_data(indexed)
        self.indexed = indexed
        self.documents = np.asarray(documents, dtype=np.int64)
        self.num_samples = num_samples
        self.config = config
        self.split = split
        self.description = {
            "format": _INDEX_FORMAT,
            "class": "BERTMaskedDataset",
            "path_prefix": os.path.abspath(indexed.path_prefix),
            "sequences": len(indexed),
            "tokens": int(indexed.sequence_lengths.sum(dtype=np.int64)),
            "split": split,
            "documents": [int(self.documents[0]), int(self.documents[-1]) + 1] if self.documents.size else [0, 0],
            "num_samples": num_samples,
            "seq_length": config.seq_length,
            "seed": config.seed,
            "short_seq_prob": config.short_seq_prob,
            "binary_head": config.binary_head,
        }
        self.hash = description_hash(self.description)
        cache = IndexCache(cache_dir, self.description, "BERTMaskedDataset", split, ("sample_index",))
        self.sample_index = cache.load_or_build(self._build_sample_index, may_save=build)["sample_index"]

    def _build_sample_index(self) -> Dict[str, np.ndarray]:
        if self.documents.size == 0:
            raise ValueError(f"the {self.split} split of {self.indexed.path_prefix} has no documents")
        t0 = time.time()
        beg, end = self.description["documents"]
        bounds = np.asarray(self.indexed.document_indices[beg:end + 1], dtype=np.int64)
        try:
            sample_index = build_sample_map(bounds, self.indexed.sequence_lengths, self.num_samples,
                                            self.config.seq_length - 3, self.config.short_seq_prob,
                                            self.config.seed, 2 if self.config.binary_head else 1)
        except ValueError as err:
            hint = " (the binary head needs two; --bert-no-binary-head takes one)" if self.config.binary_head else ""
            raise ValueError(f"the {self.split} split of {self.indexed.path_prefix} (documents [{beg}, {end})): "
                             f"{err}{hint}") from None
        logger.info("built BERTMaskedDataset %s sample map (%d samples) in %.2f s", self.split,
                    sample_index.shape[0], time.time() - t0)
        return {"sample_index": sample_index}

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def __getitem__(self, idx) -> Dict[str, object]:
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples ({self.split})")
        first, end, target = (int(x) for x in self.sample_index[idx])
        cfg, vocab = self.config, self.config.vocab
        if target > cfg.seq_length:
            raise AssertionError(f"target length {target} exceeds --seq-length {cfg.seq_length}")
        sentences = [self.indexed[s].tolist() for s in range(first, end)]
        rng = np.random.RandomState((cfg.seed + idx) % 2**32)

        pivot, is_random = len(sentences), False
        if cfg.binary_head:
            if len(sentences) < 2:
                raise AssertionError(f"sample {idx} has {len(sentences)} sentence; the binary head needs two")
            pivot = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
            is_random = rng.random() < 0.5
        seg_a: List[int] = [t for s in sentences[:pivot] for t in s]
        seg_b: List[int] = [t for s in sentences[pivot:] for t in s]
        if is_random:
            seg_a, seg_b = seg_b, seg_a
        truncated = len(seg_a) + len(seg_b) > target
        seg_a, seg_b = _truncate(seg_a, seg_b, target, rng)

        tokens = [vocab.cls, *seg_a, vocab.sep]
        types = [0] * len(tokens)
        if seg_b:
            tokens += [*seg_b, vocab.sep]
            types += [1] * (len(seg_b) + 1)
        tokens, positions, originals = mask_tokens(tokens, target, rng, cfg.masking, vocab.cls, vocab.sep,
                                                   vocab.mask, vocab.continuation, vocab.lookup)

        pad, n = vocab.pad, cfg.seq_length
        text = np.full(n, pad, dtype=np.int64)
        text[:len(tokens)] = tokens
        token_types = np.full(n, pad, dtype=np.int64)
        token_types[:len(types)] = types
        padding_mask = np.ones(n, dtype=np.int64)
        padding_mask[text == pad] = pad
        labels = np.full(n, -1, dtype=np.int64)
        labels[positions] = originals
        loss_mask = np.zeros(n, dtype=np.int64)
        loss_mask[positions] = 1
        text[text == pad] = 0
        labels[labels == pad] = 0
        return {"text": text, "types": token_types, "labels": labels, "is_random": int(is_random),
                "padding_mask": padding_mask, "loss_mask": loss_mask, "truncated": int(truncated)}


def _truncate(seg_a: List[int], seg_b: List[int], target: int, rng: np.random.RandomState):
    """Drop tokens from the front or back of the longer segment until both fit in ``target``."""
    a0, a1, b0, b1 = 0, len(seg_a), 0, len(seg_b)
    while (a1 - a0) + (b1 - b0) > target:
        front = rng.random() < 0.5
        if a1 - a0 > b1 - b0:
            a0, a1 = (a0 + 1, a1) if front else (a0, a1 - 1)
        else:
            b0, b1 = (b0 + 1, b1) if front else (b0, b1 - 1)
    return seg_a[a0:a1], seg_b[b0:b1]
