"""``pretrain_gpt.py --load <Megatron-LM torch_dist checkpoint>`` end to end: the fixture
``tests/unit/checkpoint/fixtures/megatron_gpt_torch_dist`` was written by Megatron-Core 0.15's own ``torch_dist``
save path (``MCoreMetadata`` in ``.metadata``) from a data-parallel run of two ranks with the distributed optimizer
(``fixtures/make_megatron_torch_dist_optim_fixture.py``). The real entry point resumes it, weights, Adam moments,
fp32 main copies, step, scheduler and consumed samples, and logs the ten losses Megatron-Core logged when it
continued the same run on the same samples (bf16, 1e-3). The reader of the same folder is checked by parameter in
``tests/unit/checkpoint/test_megatron_format.py``."""

import json
import os

import pytest
import torch

from megatron.core.checkpoint_formats import read_megatron_checkpoint
from tests.functional.harness import parse_iterations, run_pretrain
from tests.functional.test_checkpoint_megatron_fixture_pretrain import FIXTURES, _argv

CKPT = os.path.join(FIXTURES, "megatron_gpt_torch_dist")
GOLDEN = json.load(open(os.path.join(CKPT, "megatron_core_resume_on_data.json")))


def _torch_dist_argv(cache: str, **extra) -> list:
    """The fixture run's flags: hidden 32, global batch 4 (micro-batch 2 on each of two ranks), gradient clipping at
    1, the distributed optimizer."""
    flags = {"hidden-size": 32, "micro-batch-size": 2, "global-batch-size": 4, "clip-grad": 1.0,
             "use-distributed-optimizer": True, "load": CKPT}
    flags.update(extra)
    return _argv(cache, **flags)


def test_pretrain_gpt_resumes_a_megatron_lm_torch_dist_checkpoint_and_saves_torch_dist(tmp_path):
    """The fixture's own layout (two data-parallel ranks under torchrun, micro-batch 2, the distributed optimizer):
    Megatron-Core's next ten losses, and ``--ckpt-format torch_dist`` saves the final iteration with the
    distributed optimizer's state gathered from both ranks (each fp32 main copy rounds to its bf16 weight)."""
    save = str(tmp_path / "save")
    argv = _torch_dist_argv(str(tmp_path / "cache"), save=save, **{"save-interval": 13, "ckpt-format": "torch_dist"})
    proc = run_pretrain(argv, nproc=2)
    its = parse_iterations(proc.stdout)
    assert "reading the Megatron-Core torch_dist checkpoint" in proc.stdout
    first = GOLDEN["first_iteration"] + 1
    assert sorted(its) == list(range(first, 14))
    assert f"iteration        {first}/      13 | consumed samples:           16 |" in proc.stdout
    assert [its[i]["lm loss"] for i in range(first, 14)] == pytest.approx(GOLDEN["losses"], abs=1e-3, rel=0)
    saved = read_megatron_checkpoint(save)
    named, meta = saved.extra["optimizer_by_name"][(0, 0)]
    assert (saved.iteration, saved.consumed_samples, meta["step"]) == (13, 52, 13.0)
    weights = saved.model_state_per_rank[(0, 0)][0]
    for name, entry in named[0].items():
        torch.testing.assert_close(entry["param"].to(weights[name].dtype), weights[name], atol=0, rtol=0)
