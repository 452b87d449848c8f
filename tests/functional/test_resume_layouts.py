"""Resume is bit-exact with dropout on in every parallel layout: tensor parallelism with sequence parallelism
(dropout in the sequence-split regions), pipeline parallelism, and data parallelism with the distributed optimizer
in bf16 (sharded fp32 main weights).

Each layout trains 6 iterations once, saving at iteration 3. A second process loads that checkpoint and trains
iterations 4 to 6; their loss and gradient norm must equal the uninterrupted run's as exact float bits (the
driver of ``test_kill_resume.py`` appends them to each iteration line). A checkpoint written by a run that goes
on is the one a stop at that iteration (``--exit-interval``, a signal) writes: the same save, then either the
next iteration or the exit.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.functional.harness import ROOT, _free_port, gpt_args
from tests.functional.test_kill_resume import DRIVER, _exact_lines

TRAIN_ITERS, STOP = 6, 3
LAYOUTS = {
    "tp2_sp": dict(tp=2, tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "dp2_distopt_bf16": dict(use_distributed_optimizer=True, bf16=True),
}


def _run(driver, argv, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), driver, os.path.join(ROOT, "pretrain_gpt.py")] + argv
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return {it: (loss, norm) for it, loss, norm in _exact_lines(proc.stdout)}, proc.stdout


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_resume_with_dropout_is_bit_exact(data_prefix, tmp_path, layout):
    driver = str(tmp_path / "driver.py")
    with open(driver, "w") as f:
        f.write(DRIVER)
    ckpt = tmp_path / "ckpt"
    common = dict(num_layers=2, train_iters=TRAIN_ITERS, hidden_dropout=0.1, attention_dropout=0.1,
                  **LAYOUTS[layout])
    straight, _ = _run(driver, gpt_args(data_prefix, save=str(ckpt), save_interval=STOP, **common))
    assert sorted(straight) == list(range(1, TRAIN_ITERS + 1))

    # the folder as a stop at iteration STOP leaves it
    shutil.rmtree(ckpt / f"iter_{TRAIN_ITERS:07d}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(STOP))
    resumed, out = _run(driver, gpt_args(data_prefix, load=str(ckpt), **common))
    assert f"loaded checkpoint from {ckpt} at iteration {STOP}" in out
    assert sorted(resumed) == list(range(STOP + 1, TRAIN_ITERS + 1))
    for it, bits in resumed.items():
        assert bits == straight[it], f"iteration {it}: (loss, grad norm) {bits} vs uninterrupted {straight[it]}"
