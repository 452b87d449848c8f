"""``--load`` of a checkpoint saved at another TP/PP reshards it at load time: a run saved at TP=1 continues at
TP=2 x PP=2 (model and optimizer resharded, fp32, dropout 0) with the losses of the run that was not resharded."""

import os

from tests.functional.harness import assert_same_losses, gpt_args, losses, parse_iterations, run_pretrain


def test_tp1_checkpoint_resumes_at_tp2_pp2_with_the_same_losses(data_prefix, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # the uninterrupted TP=1 run, saving at iterations 2 and 4; the resume starts from iteration 2
    straight = losses(gpt_args(data_prefix, train_iters=4, save=ckpt, save_interval=2))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    # make-vocab-size-divisible-by 512 at TP=1 and 256 at TP=2 (gpt_args): the same padded vocabulary
    argv = gpt_args(data_prefix, tp=2, pipeline_model_parallel_size=2, train_iters=4, load=ckpt)
    proc = run_pretrain(argv, nproc=4)
    resumed = parse_iterations(proc.stdout)
    assert sorted(resumed) == [3, 4]
    assert "saved at TP=1, PP=1) to TP=2, PP=2" in proc.stdout
    assert "RNG state not restored" in proc.stdout
    assert_same_losses({it: straight[it] for it in (3, 4)}, resumed, rel=1e-5, keys=("lm loss", "grad norm"))
