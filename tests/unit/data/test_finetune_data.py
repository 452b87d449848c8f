"""The fine-tuning readers (GLUE MNLI/QQP TSV, RACE JSON) and the pair layout, on small hand-made files."""

import json

import numpy as np
import pytest

from megatron.core.datasets.finetune_data import (FinetuneDataError, FinetuneDataset, build_pair, clean_text,
                                                  read_mnli, read_qqp, read_race)

MNLI_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
               "sentence2_parse\tsentence1\tsentence2")


def test_mnli_columns_labels_and_test_file(tmp_path):
    train = tmp_path / "train.tsv"
    train.write_text(MNLI_HEADER + "\tlabel1\tgold_label\n"
                     "7\t\t\t\t\t\t\t\tA  cat sat .  here\tA dog.\tneutral\tneutral\n"
                     "8\t\t\t\t\t\t\t\tx\ty\tcontradiction\tentailment\n")
    ex = read_mnli(str(train))
    assert [(e.uid, e.text_a, e.text_b, e.label) for e in ex] == [(7, "A cat sat. here", "A dog.", 2),
                                                                  (8, "x", "y", 1)]  # the last column is the label
    test = tmp_path / "test.tsv"
    test.write_text(MNLI_HEADER + "\n3\t\t\t\t\t\t\t\tp\th\n")
    assert [(e.text_a, e.label) for e in read_mnli(str(test))] == [("p", 0)]  # no label: contradiction
    bad = tmp_path / "bad.tsv"
    bad.write_text(MNLI_HEADER + "\tgold_label\n1\t\t\t\t\t\t\t\ta\tb\tmaybe\n")
    with pytest.raises(FinetuneDataError, match="line 2: label 'maybe'"):
        read_mnli(str(bad))


def test_qqp_train_and_test_layouts(tmp_path):
    train = tmp_path / "train.tsv"
    train.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                     "5\t1\t2\tWhy?\tHow?\t1\n6\t3\t4\tbroken row\t0\n7\t5\t6\t\tempty\t0\n8\t7\t8\tA\tB\t0\n")
    assert [(e.uid, e.text_a, e.text_b, e.label) for e in read_qqp(str(train))] == [(5, "Why?", "How?", 1),
                                                                                  (8, "A", "B", 0)]
    test = tmp_path / "test.tsv"
    test.write_text("id\tquestion1\tquestion2\n0\tq one\tq two\n")
    assert [(e.text_a, e.text_b, e.label) for e in read_qqp(str(test))] == [("q one", "q two", 0)]


def test_race_options_blanks_and_folders(tmp_path):
    (tmp_path / "high").mkdir()
    passage = {"article": "The  article.\n", "questions": ["He went to _ .", "Where?"],
               "options": [["a", "b", "c", "d"], ["e", "f", "g", "h"]], "answers": ["C", "A"]}
    (tmp_path / "high" / "1.txt").write_text(json.dumps(passage))
    ex = read_race(str(tmp_path))
    assert ex[0].text_a == ("He went to a .", "He went to b .", "He went to c .", "He went to d .")
    assert ex[1].text_a == ("Where? e", "Where? f", "Where? g", "Where? h")
    assert [e.label for e in ex] == [2, 0] and ex[0].text_b == "The article. "
    (tmp_path / "empty").mkdir()
    with pytest.raises(FinetuneDataError, match="no RACE passage files"):
        read_race(str(tmp_path / "empty"))
    with pytest.raises(FinetuneDataError, match="no such file or folder"):
        read_race(str(tmp_path / "none"))


def test_pair_layout_truncates_the_end():
    ids, types, mask = build_pair([5, 6], [7, 8, 9], 8, cls=1, sep=2, pad=0)
    assert (ids, types, mask) == ([1, 5, 6, 2, 7, 8, 9, 2], [0, 0, 0, 0, 1, 1, 1, 1], [1] * 8)
    ids, types, mask = build_pair([5, 6], [7, 8, 9, 10], 7, cls=1, sep=2, pad=0)
    assert ids == [1, 5, 6, 2, 7, 8, 2] and types == [0, 0, 0, 0, 1, 1, 1]
    ids, types, mask = build_pair([5], [7], 7, cls=1, sep=2, pad=0)
    assert ids == [1, 5, 2, 7, 2, 0, 0] and mask == [1, 1, 1, 1, 1, 0, 0] and types == [0, 0, 0, 1, 1, 0, 0]
    assert clean_text("a\n b  .  c . d") == "a b. c. d"


class _Tok:
    cls, sep, pad = 1, 2, 0

    def tokenize_batch(self, texts):
        return [[10 + len(w) for w in t.split()] for t in texts]


def test_race_dataset_cuts_the_question_and_option_to_128_tokens():
    from megatron.core.datasets.finetune_data import RawExample

    long_qa = " ".join(["q"] * 200)
    ex = [RawExample(uid=0, text_a=(long_qa, "x", "y", "z"), text_b="art icle", label=3)]
    ds = FinetuneDataset(ex, _Tok(), 140)
    assert ds.text.shape == (1, 4, 140) and ds.multiple_choice
    first = ds.text[0, 0]
    assert first[0] == 1 and first[129] == 2 and list(first[130:132]) == [13, 14] and first[132] == 2
    assert np.array_equal(ds.batch([0])["label"], [3])
