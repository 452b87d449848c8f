"""``pretrain_gpt.py --load <Megatron-LM checkpoint>`` end to end: the real entry point resumes the Megatron-Core
fixture (``tests/unit/checkpoint/fixtures/megatron_gpt``, a 64-id vocabulary) with Megatron-LM's
``--tokenizer-type NullTokenizer --vocab-size 63`` on a tiny ``.bin/.idx`` of ids, and its ten logged losses are
the ones Megatron-Core logs when it resumes the same checkpoint on the same samples of the same files
(``megatron_core_resume_on_data.json``, made by ``fixtures/make_megatron_data_resume_golden.py``; bf16, 1e-3)."""

import hashlib
import json
import os

import pytest

from tests.functional.harness import ROOT, parse_iterations, run_pretrain

FIXTURES = os.path.join(ROOT, "tests", "unit", "checkpoint", "fixtures")
CKPT = os.path.join(FIXTURES, "megatron_gpt")
PREFIX = os.path.join(FIXTURES, "megatron_gpt_data", "ids_text_document")
GOLDEN = json.load(open(os.path.join(CKPT, "megatron_core_resume_on_data.json")))


def _argv(cache: str, **extra) -> list:
    """The fixture run's flags (its saved arguments; no clipping, as it ran), now 13 iterations long with the
    schedule's decay still ending at iteration 10."""
    opts = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "ffn-hidden-size": 64, "seq-length": 16,
            "max-position-embeddings": 16, "micro-batch-size": 2, "global-batch-size": 2, "train-iters": 13,
            "lr": 1e-3, "min-lr": 1e-4, "lr-warmup-iters": 2, "lr-decay-iters": 10, "lr-decay-style": "cosine",
            "weight-decay": 0.01, "adam-beta1": 0.9, "adam-beta2": 0.95, "adam-eps": 1e-8, "clip-grad": 0.0,
            "hidden-dropout": 0.0, "attention-dropout": 0.0, "seed": 1234, "bf16": True,
            "tokenizer-type": "NullTokenizer", "vocab-size": 63, "make-vocab-size-divisible-by": 64,
            "data-path": PREFIX, "split": "100,0,0", "data-cache-path": cache, "eval-iters": 0, "log-interval": 1,
            "num-workers": 0, "load": CKPT}
    opts.update(extra)
    argv = []
    for key, value in opts.items():
        if value is False:
            continue
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_pretrain_gpt_resumes_the_megatron_fixture_on_megatron_cores_curve(tmp_path):
    assert (_sha(PREFIX + ".bin"), _sha(PREFIX + ".idx")) == (GOLDEN["bin_sha256"], GOLDEN["idx_sha256"])
    proc = run_pretrain(_argv(str(tmp_path / "cache")))
    its = parse_iterations(proc.stdout)
    assert "reading the Megatron-LM checkpoint" in proc.stdout
    assert "vocabulary 64 padded to 64" in proc.stdout
    # iteration, consumed samples and the scheduler position carried over: training continues at iteration 4 with
    # 8 samples consumed after it, on the learning rate of Megatron-Core's schedule
    first = GOLDEN["first_iteration"] + 1
    assert sorted(its) == list(range(first, 14))
    assert f"iteration        {first}/      13 | consumed samples:            8 |" in proc.stdout
    got = [its[i]["lm loss"] for i in range(first, 14)]
    assert got == pytest.approx(GOLDEN["losses"], abs=1e-3, rel=0)
    # the comparison can fail: with a fresh optimizer (--no-load-optim) the curve leaves Megatron-Core's
    fresh = parse_iterations(run_pretrain(_argv(str(tmp_path / "cache"), **{"no-load-optim": True})).stdout)
    assert max(abs(fresh[i]["lm loss"] - want) for i, want in zip(range(first, 14), GOLDEN["losses"])) > 1e-2


def test_null_tokenizer_needs_its_vocabulary_size(tmp_path):
    argv = _argv(str(tmp_path / "cache"))
    at = argv.index("--vocab-size")
    proc = run_pretrain(argv[:at] + argv[at + 2:], expect_ok=False)
    assert proc.returncode == 2
    assert "--tokenizer-type NullTokenizer needs --vocab-size" in proc.stderr.strip().splitlines()[-1]
