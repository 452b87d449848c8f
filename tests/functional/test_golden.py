"""Golden per-iteration losses of tiny configurations, so a refactor that changes the numerics is noticed.

Regenerate (only when a change of numerics is intended, and say why in the commit):
    python tests/functional/test_golden.py --regenerate
The tolerance (relative 2e-4 on the loss, 2e-3 on the grad norm) absorbs fp32 differences between CPU types;
layout equivalence itself is checked far more tightly in test_parallel_equivalence.py.
"""

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from tests.functional.harness import gpt_args, losses_of_many, preprocess_quickstart_corpus  # noqa: E402

GOLDEN = os.path.join(HERE, "golden", "gpt_losses.json")
CONFIGS = {
    "gpt-4l-h64-fp32-unfused": {},
    "gpt-4l-h64-sdpa-selective-recompute": {"attention_backend": "auto", "recompute_granularity": "selective"},
    "gpt-2l-h64-untied-sgd": {"num_layers": 2, "untie_embeddings_and_output_weights": True, "optimizer": "sgd",
                              "lr": 0.05, "min_lr": 0.005},
}


def _curve(out):
    return {str(k): {"lm loss": v["lm loss"], "grad norm": v["grad norm"]} for k, v in sorted(out.items())}


@pytest.fixture(scope="module")
def runs(data_prefix, run_cache):
    """The configurations train one after another in one process."""
    return run_cache.losses({name: (1, gpt_args(data_prefix, **flags)) for name, flags in CONFIGS.items()})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_losses_match_golden(runs, name):
    golden = json.load(open(GOLDEN))[name]
    got = _curve(runs[name])
    assert sorted(got) == sorted(golden)
    for it, ref in golden.items():
        assert got[it]["lm loss"] == pytest.approx(ref["lm loss"], rel=2e-4), (name, it)
        assert got[it]["grad norm"] == pytest.approx(ref["grad norm"], rel=2e-3), (name, it)


if __name__ == "__main__" and "--regenerate" in sys.argv:
    import tempfile

    prefix = preprocess_quickstart_corpus(tempfile.mkdtemp())
    names = sorted(CONFIGS)
    curves = losses_of_many([gpt_args(prefix, **CONFIGS[name]) for name in names])
    result = {name: _curve(out) for name, out in zip(names, curves)}
    with open(GOLDEN, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"wrote {GOLDEN}")
