"""Readers and samples of the BERT fine-tuning tasks: GLUE's MNLI and QQP (TSV) and RACE (JSON per passage).

Every reader returns ``RawExample`` s; ``build_dataset`` turns them into fixed-length samples as Megatron-LM built
them:

- a pair is ``[CLS] A [SEP] B [SEP]``: token type 0 up to the first [SEP], 1 after it; when it is too long the
  end is cut (``A B`` truncated to ``seq_length - 1`` tokens, then the last [SEP]); padding with [PAD], type 0 and
  padding mask 0;
- MNLI: ``sentence1`` / ``sentence2`` (columns 8 and 9) and the last column's label, numbered
  contradiction 0, entailment 1, neutral 2 (train.tsv and dev_matched/dev_mismatched.tsv; a 10-column test file has
  no labels and reads as contradiction);
- QQP: ``question1`` / ``question2`` (columns 3 and 4) and ``is_duplicate`` (column 5) of the 6-column train/dev
  files; the 3-column test file (``id, question1, question2``) has no labels and reads as 0; rows with another
  number of columns or an empty question are skipped;
- RACE: one JSON object per passage (``article``, ``questions``, ``options``, ``answers``), files ``*.txt`` under
  a folder (and its ``high/`` and ``middle/``); each question gives four sequences ``[CLS] QA [SEP] article [SEP]``
  where QA is the question with its blank ``_`` replaced by the option (or the option appended after a space), cut
  to 128 tokens; the label is the answer letter's index.

Texts are cleaned as Megatron did (newlines and runs of whitespace become one space, `` . `` becomes ``. ``).
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

MNLI_LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
QQP_LABELS = {"0": 0, "1": 1}
RACE_CHOICES = 4
RACE_MAX_QA_LENGTH = 128
TASKS = {"MNLI": len(MNLI_LABELS), "QQP": len(QQP_LABELS), "RACE": RACE_CHOICES}  # task -> classes or choices
# class i's name, as GLUE names them (the exported Hugging Face config's id2label)
LABEL_NAMES = {"MNLI": tuple(sorted(MNLI_LABELS, key=MNLI_LABELS.get)), "QQP": ("not_duplicate", "duplicate")}


class FinetuneDataError(ValueError):
    """A data file that cannot be read as the task's layout (one line naming the file and the problem)."""


@dataclass(frozen=True)
class RawExample:
    """``text_a``: one text, or (RACE) one text per choice; ``text_b``: the second segment (shared by the choices)."""
    uid: int
    text_a: object  # str, or a tuple of str (one per choice)
    text_b: Optional[str]
    label: int


def clean_text(text: str) -> str:
    text = re.sub(r"\s+", " ", text.replace("\n", " "))
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def _tsv_rows(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise FinetuneDataError(f"{path}: {exc.strerror or exc}") from None
    if not lines:
        raise FinetuneDataError(f"{path}: empty file (expected a header line and rows)")
    return [line.split("\t") for line in lines]


def read_mnli(path: str) -> List[RawExample]:
    rows = _tsv_rows(path)
    is_test = len(rows[0]) == 10
    if not is_test and (len(rows[0]) < 11 or rows[0][8] != "sentence1" or rows[0][9] != "sentence2"):
        raise FinetuneDataError(f"{path}: not a GLUE MNLI file (expected columns 8, 9 sentence1, sentence2 and the "
                                f"label last; the header has {len(rows[0])} columns)")
    out = []
    for n, row in enumerate(rows[1:], start=2):
        if len(row) < 10:
            raise FinetuneDataError(f"{path} line {n}: {len(row)} columns, an MNLI row has at least 10")
        label = "contradiction" if is_test else row[-1].strip()
        if label not in MNLI_LABELS:
            raise FinetuneDataError(f"{path} line {n}: label {label!r} is not one of {', '.join(MNLI_LABELS)}")
        a, b = clean_text(row[8].strip()), clean_text(row[9].strip())
        if not a or not b:
            raise FinetuneDataError(f"{path} line {n}: empty sentence1 or sentence2")
        out.append(RawExample(uid=int(row[0]) if row[0].strip().isdigit() else n - 2, text_a=a, text_b=b,
                              label=MNLI_LABELS[label]))
    return out


def read_qqp(path: str) -> List[RawExample]:
    rows = _tsv_rows(path)
    is_test = len(rows[0]) == 3
    if not is_test and (len(rows[0]) != 6 or rows[0][3] != "question1"):
        raise FinetuneDataError(f"{path}: not a GLUE QQP file (expected the 6 columns id, qid1, qid2, question1, "
                                f"question2, is_duplicate, or the test file's id, question1, question2)")
    out = []
    for n, row in enumerate(rows[1:], start=2):
        if is_test:
            if len(row) != 3:
                continue
            uid, a, b, label = row[0], row[1], row[2], "0"
        else:
            if len(row) != 6:
                continue
            uid, a, b, label = row[0], row[3], row[4], row[5].strip()
        a, b = clean_text(a.strip()), clean_text(b.strip())
        if not a or not b:
            continue
        if label not in QQP_LABELS:
            raise FinetuneDataError(f"{path} line {n}: is_duplicate {label!r} is not 0 or 1")
        out.append(RawExample(uid=int(uid) if uid.strip().isdigit() else n - 2, text_a=a, text_b=b,
                              label=QQP_LABELS[label]))
    return out


def race_files(path: str) -> List[str]:
    """The passage files of a RACE path: a file, or every ``*.txt`` in a folder and its ``high/``, ``middle/``."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FinetuneDataError(f"{path}: no such file or folder")
    files = sorted(glob.glob(os.path.join(path, "*.txt")))
    for level in ("high", "middle"):
        files += sorted(glob.glob(os.path.join(path, level, "*.txt")))
    if not files:
        raise FinetuneDataError(f"{path}: no RACE passage files (*.txt) in it or in its high/ and middle/ folders")
    return files


def read_race(path: str) -> List[RawExample]:
    out = []
    for file in race_files(path):
        try:
            with open(file, encoding="utf-8") as f:
                passage = json.load(f)
            article, questions = passage["article"], passage["questions"]
            options, answers = passage["options"], passage["answers"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FinetuneDataError(f"{file}: not a RACE passage (JSON with article, questions, options, answers): "
                                    f"{exc}") from None
        if not len(questions) == len(options) == len(answers):
            raise FinetuneDataError(f"{file}: {len(questions)} questions, {len(options)} option lists and "
                                    f"{len(answers)} answers")
        article = clean_text(article)
        for question, opts, answer in zip(questions, options, answers):
            label = ord(answer) - ord("A") if isinstance(answer, str) and len(answer) == 1 else -1
            if len(opts) != RACE_CHOICES or not 0 <= label < RACE_CHOICES:
                raise FinetuneDataError(f"{file}: a question needs {RACE_CHOICES} options and an answer A-D, got "
                                        f"{len(opts)} options and answer {answer!r}")
            qa = tuple(clean_text(question.replace("_", o) if "_" in question else f"{question} {o}") for o in opts)
            out.append(RawExample(uid=len(out), text_a=qa, text_b=article, label=label))
    return out


READERS = {"MNLI": read_mnli, "QQP": read_qqp, "RACE": read_race}


def read_examples(task: str, paths: Sequence[str]) -> List[RawExample]:
    """Every example of ``paths`` (in order) read as ``task``'s layout."""
    if task not in READERS:
        raise FinetuneDataError(f"--task {task}: no reader (supported: {', '.join(READERS)})")
    out = []
    for path in paths:
        out.extend(READERS[task](path))
    return out


def build_pair(a: List[int], b: Optional[List[int]], seq_length: int, cls: int, sep: int, pad: int):
    """``(ids, types, padding mask)`` of ``[CLS] a [SEP] b [SEP]`` cut at the end to ``seq_length``, padded."""
    ids = [cls] + list(a) + [sep]
    types = [0] * len(ids)
    if b is not None:
        ids += list(b)
        types += [1] * len(b)
    ids, types = ids[: seq_length - 1], types[: seq_length - 1]
    ids.append(sep)
    types.append(1 if b is not None else 0)
    n = len(ids)
    pad_n = seq_length - n
    return ids + [pad] * pad_n, types + [0] * pad_n, [1] * n + [0] * pad_n


class FinetuneDataset:
    """Fixed-length samples of one task: ``{"text", "types", "padding_mask"}`` int64 ``[s]`` (``[4, s]`` for RACE),
    ``"label"`` and ``"uid"``."""

    def __init__(self, examples: List[RawExample], tokenizer, seq_length: int, max_qa_length: int = RACE_MAX_QA_LENGTH):
        if seq_length < 3:
            raise FinetuneDataError(f"--seq-length {seq_length} is too short for [CLS] A [SEP] B [SEP]")
        multi = bool(examples) and isinstance(examples[0].text_a, tuple)
        texts = []
        for ex in examples:
            texts.extend(ex.text_a if multi else (ex.text_a,))
            texts.append(ex.text_b)
        ids = tokenizer.tokenize_batch(texts)
        cls, sep, pad = tokenizer.cls, tokenizer.sep, tokenizer.pad
        n_a = RACE_CHOICES if multi else 1
        shape = (len(examples), n_a, seq_length) if multi else (len(examples), seq_length)
        self.text = np.zeros(shape, dtype=np.int64)
        self.types = np.zeros(shape, dtype=np.int64)
        self.padding_mask = np.zeros(shape, dtype=np.int64)
        self.label = np.array([ex.label for ex in examples], dtype=np.int64)
        self.uid = np.array([ex.uid for ex in examples], dtype=np.int64)
        pos = 0
        for i in range(len(examples)):
            firsts, second = ids[pos:pos + n_a], ids[pos + n_a]
            pos += n_a + 1
            for c, first in enumerate(firsts):
                if multi:
                    first = first[:max_qa_length]
                row = build_pair(first, second, seq_length, cls, sep, pad)
                where = (i, c) if multi else (i,)
                self.text[where], self.types[where], self.padding_mask[where] = row
        self.multiple_choice = multi

    def __len__(self) -> int:
        return len(self.label)

    def batch(self, indices: Sequence[int]) -> Dict[str, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        return {"text": self.text[idx], "types": self.types[idx], "padding_mask": self.padding_mask[idx],
                "label": self.label[idx], "uid": self.uid[idx]}


def build_dataset(task: str, paths: Sequence[str], tokenizer, seq_length: int) -> FinetuneDataset:
    return FinetuneDataset(read_examples(task, paths), tokenizer, seq_length)
