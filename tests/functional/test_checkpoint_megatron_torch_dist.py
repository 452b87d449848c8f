"""``pretrain_gpt.py --load <Megatron-LM torch_dist checkpoint>`` end to end: the fixture
``tests/unit/checkpoint/fixtures/megatron_gpt_torch_dist`` was written by Megatron-Core 0.15's own ``torch_dist``
save path (``MCoreMetadata`` in ``.metadata``) from a data-parallel run of two ranks with the distributed optimizer
(``fixtures/make_megatron_torch_dist_optim_fixture.py``). The real entry point resumes it, weights, Adam moments,
fp32 main copies, step, scheduler and consumed samples, and logs the ten losses Megatron-Core logged when it
continued the same run on the same samples (bf16, 1e-3)."""

import json
import os

import pytest

from tests.functional.harness import parse_iterations, run_pretrain
from tests.functional.test_checkpoint_megatron_fixture_pretrain import FIXTURES, _argv

CKPT = os.path.join(FIXTURES, "megatron_gpt_torch_dist")
GOLDEN = json.load(open(os.path.join(CKPT, "megatron_core_resume_on_data.json")))


def _torch_dist_argv(cache: str, **extra) -> list:
    """The fixture run's flags: hidden 32, global batch 4 (one micro-batch of 4 here, 2 x 2 ranks there), gradient
    clipping at 1, the distributed optimizer."""
    flags = {"hidden-size": 32, "micro-batch-size": 4, "global-batch-size": 4, "clip-grad": 1.0,
             "use-distributed-optimizer": True, "load": CKPT}
    flags.update(extra)
    return _argv(cache, **flags)


def test_pretrain_gpt_resumes_a_megatron_lm_torch_dist_checkpoint_with_its_optimizer(tmp_path):
    proc = run_pretrain(_torch_dist_argv(str(tmp_path / "cache")))
    its = parse_iterations(proc.stdout)
    assert "reading the Megatron-Core torch_dist checkpoint" in proc.stdout
    first = GOLDEN["first_iteration"] + 1
    assert sorted(its) == list(range(first, 14))
    assert f"iteration        {first}/      13 | consumed samples:           16 |" in proc.stdout
    got = [its[i]["lm loss"] for i in range(first, 14)]
    assert got == pytest.approx(GOLDEN["losses"], abs=1e-3, rel=0)
