"""Resume is bit-exact with dropout on in every parallel layout: tensor parallelism with sequence parallelism
(dropout in the sequence-split regions), pipeline parallelism and one process, all three with a Llama-shaped model
(RMSNorm, SwiGLU, grouped-query attention, RoPE with Llama 3.1 scaling, untied output layer, no biases), and data
parallelism with the distributed optimizer in bf16 (sharded fp32 main weights) with a GPT-2-shaped one.

One launch trains each layout twice: 6 iterations uninterrupted, then the same run stopped by
``--exit-interval 3`` after its checkpoint save. A second launch loads that checkpoint and trains iterations 4
to 6; their loss and gradient norm must equal the uninterrupted run's as exact float bits (the driver of
``test_kill_resume.py`` appends them to each iteration line).
"""

import os

import pytest

from tests.functional.harness import gpt_args, outputs_of_many
from tests.functional.test_kill_resume import DRIVER, _exact_lines
from tests.functional.test_llama_parallel_equivalence import LLAMA

TRAIN_ITERS, STOP = 6, 3
LAYOUTS = {  # name: (processes, flags)
    "llama_tp2_sp": (2, dict(LLAMA, tp=2, sequence_parallel=True)),
    "llama_pp2": (2, dict(LLAMA, pipeline_model_parallel_size=2)),
    "dp2_distopt_bf16": (2, dict(use_distributed_optimizer=True, bf16=True)),
    "llama_one_process": (1, dict(LLAMA)),
}


def _exact(driver, argvs, nproc):
    """{iteration: (loss bits, grad norm bits)} of each run, and its output, from one launch."""
    outs = outputs_of_many(argvs, nproc=nproc, driver=driver)
    return [({it: (loss, norm) for it, loss, norm in _exact_lines(out)}, out) for out in outs]


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_resume_with_dropout_is_bit_exact(data_prefix, tmp_path, layout):
    driver = str(tmp_path / "driver.py")
    with open(driver, "w") as f:
        f.write(DRIVER)
    ckpt = str(tmp_path / "ckpt")
    nproc, flags = LAYOUTS[layout]
    common = dict(num_layers=2, train_iters=TRAIN_ITERS, hidden_dropout=0.1, attention_dropout=0.1, **flags)
    (straight, _), (stopped, _) = _exact(driver, [gpt_args(data_prefix, **common),
                                                  gpt_args(data_prefix, save=ckpt, exit_interval=STOP, **common)],
                                         nproc)
    assert sorted(straight) == list(range(1, TRAIN_ITERS + 1))
    assert sorted(stopped) == list(range(1, STOP + 1))
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == str(STOP)

    [(resumed, out)] = _exact(driver, [gpt_args(data_prefix, load=ckpt, **common)], nproc)
    assert f"loaded checkpoint from {ckpt} at iteration {STOP}" in out
    assert sorted(resumed) == list(range(STOP + 1, TRAIN_ITERS + 1))
    for it, bits in {**stopped, **resumed}.items():
        assert bits == straight[it], f"iteration {it}: (loss, grad norm) {bits} vs uninterrupted {straight[it]}"
