"""tools/learn_wordpiece_vocab.py: the merges of a hand-worked example, and the same vocabulary on every run."""

import gzip
import os
import subprocess
import sys

from tests.conftest import ROOT
from tools.learn_wordpiece_vocab import SPECIAL_TOKENS, learn_vocab


def test_hand_worked_merges():
    """low x5, lower x2, newest x6, widest x3. Pair counts: (##e, ##s) and (##s, ##t) 9 each, the tie going to the
    pair that sorts first; then (##es, ##t) 9; (##o, ##w) and (l, ##o) 7 each ('#' sorts before 'l'); then
    (l, ##ow) 7; then (##e, ##w), (##w, ##est) and (n, ##e) 6 each."""
    counts = {"low": 5, "lower": 2, "newest": 6, "widest": 3}
    alphabet = ["##d", "##e", "##i", "##o", "##r", "##s", "##t", "##w", "l", "n", "w"]
    vocab = learn_vocab(counts, vocab_size=len(SPECIAL_TOKENS) + len(alphabet) + 5, min_frequency=2)
    assert vocab == [*SPECIAL_TOKENS, *alphabet, "##es", "##est", "##ow", "low", "##ew"]
    # pairs seen fewer than min_frequency times are never merged
    assert learn_vocab({"ab": 1}, vocab_size=100, min_frequency=2) == [*SPECIAL_TOKENS, "##b", "a"]


def test_same_vocabulary_whatever_the_hash_seed(tmp_path):
    with gzip.open(os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "rt", encoding="utf-8") as f:
        (tmp_path / "corpus.jsonl").write_text("".join(line for _, line in zip(range(150), f)), encoding="utf-8")
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"vocab{seed}.txt"
        r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "learn_wordpiece_vocab.py"), "--input",
                            str(tmp_path / "corpus.jsonl"), "--vocab-size", "1500", "--output", str(out)],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stderr
        outputs.append(out.read_text(encoding="utf-8"))
    assert outputs[0] == outputs[1]
    tokens = outputs[0].splitlines()
    assert len(tokens) == 1500 and tokens[:5] == list(SPECIAL_TOKENS) and len(set(tokens)) == 1500
