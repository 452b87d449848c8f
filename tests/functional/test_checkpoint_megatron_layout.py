"""``pretrain_gpt.py --ckpt-layout megatron``: a run saved in Megatron-LM's layout resumes bit for bit (dropout on).

TP=2 with the distributed optimizer and bf16: every tensor-parallel rank writes its own
``mp_rank_TT/model_optim_rng.pt`` and Megatron-LM's ``distrib_optim.pt``; the resumed run prints the losses and grad
norms of the uninterrupted one, so model, fp32 main params, Adam moments, scheduler, RNG (dropout on), iteration
and consumed samples all came back from Megatron-LM's layout.
"""

import json
import os

import torch

from megatron.core.checkpoint_formats import load_megatron_file
from megatron.core.checkpoint_formats.safe_load import to_plain
from tests.functional.harness import assert_same_losses, gpt_args, losses, losses_of_many


def test_megatron_layout_resume_is_bit_exact_tp2_distributed_optimizer(data_prefix, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    layout = dict(tp=2, num_layers=2, hidden_dropout=0.1, attention_dropout=0.1, bf16=True,
                  use_distributed_optimizer=True)
    straight, first = losses_of_many(
        [gpt_args(data_prefix, train_iters=6, **layout),
         gpt_args(data_prefix, train_iters=6, exit_interval=3, save=ckpt, ckpt_layout="megatron", **layout)], nproc=2)
    second = losses(gpt_args(data_prefix, train_iters=6, load=ckpt, **layout), nproc=2)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    assert_same_losses(straight, {**first, **second}, rel=0.0, keys=("lm loss", "grad norm"))

    folder = os.path.join(ckpt, "iter_0000003")
    names = sorted(os.listdir(folder))
    assert names == ["manifest.json", "mp_rank_00", "mp_rank_01"]
    files = [f"{rank}/{name}" for rank in names[1:] for name in ("distrib_optim.pt", "model_optim_rng.pt")]
    assert sorted(json.load(open(os.path.join(folder, "manifest.json")))["files"]) == files
    for tp_rank in (0, 1):
        rank_dir = os.path.join(folder, f"mp_rank_{tp_rank:02d}")
        state = load_megatron_file(os.path.join(rank_dir, "model_optim_rng.pt"))
        args = to_plain(state["args"])
        assert (args["consumed_train_samples"], args["tensor_model_parallel_size"], args["data_parallel_size"],
                args["use_distributed_optimizer"]) == (24, 2, 1, True)
        # the distributed optimizer's model_optim_rng.pt holds only the param groups (with the step)
        groups = state["optimizer"]["optimizer"]["param_groups"]
        assert set(state["optimizer"]) == {"optimizer"} and [g["step"] for g in groups] == [3.0, 3.0]
        assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
        assert state["opt_param_scheduler"]["num_steps"] == 24 and state["iteration"] == 3
        distrib = load_megatron_file(os.path.join(rank_dir, "distrib_optim.pt"))
        entry = distrib[0][(torch.bfloat16, torch.float32)]
        assert distrib["buckets_coalesced"] and set(entry) == {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}
        assert entry["param"].dtype == torch.float32 and entry["exp_avg_sq"].abs().sum() > 0
