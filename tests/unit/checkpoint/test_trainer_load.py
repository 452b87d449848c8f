"""The trainer's ``--load`` (``megatron.training.checkpointing.load_checkpoint``) on Megatron-LM checkpoints written
by Megatron-Core's own code (tests/unit/checkpoint/fixtures/make_megatron_fixture.py says how): model, mixed-precision
optimizer, sample-based scheduler, RNG, iteration and consumed samples carry over, and the next ten losses are
Megatron-Core's own continuation of the run; ``--finetune``, ``--no-load-optim`` and ``--no-load-rng`` work; a
``torch_dist`` folder loads with ``--no-load-optim`` and says that it needs it otherwise."""

import json
import os
import random

import numpy as np
import pytest
import torch

from megatron.core.checkpoint_formats import dims_from_args, load_megatron_file, read_megatron_checkpoint
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpointing
from megatron.training.config import CheckpointConfig
from megatron.training.scheduler import OptimizerParamScheduler
from tests.unit.checkpoint.helpers import FIXTURE, build_stage

DIST_FIXTURE = os.path.join(os.path.dirname(FIXTURE), "megatron_gpt_dist")
RAW = os.path.join(FIXTURE, "iter_0000003", "mp_rank_00", "model_optim_rng.pt")


def _cfg(load, **flags):
    base = dict(save=None, load=load, save_interval=None, no_save_optim=False, no_save_rng=False,
                no_load_optim=False, no_load_rng=False, finetune=False, use_checkpoint_args=False,
                exit_on_missing_checkpoint=False, ckpt_fallback_on_corruption=False, keep_last_checkpoints=None)
    base.update(flags)
    return CheckpointConfig(**base)


def _golden():
    return torch.load(os.path.join(FIXTURE, "golden.pt"), weights_only=True)


def _run_state(seed: int = 5, root: str = FIXTURE):
    """This run's bf16 model (randomly initialised: everything must come from the file), its mixed-precision
    optimizer and its scheduler built from the run's own flags (those of the Megatron-LM run)."""
    dims = dims_from_args(read_megatron_checkpoint(root, load_optim=False, load_rng=False).args_dict)
    model = build_stage(dims, ParallelState.single(), dtype=torch.bfloat16, seed=seed)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, weight_decay=0.01, clip_grad=0.0,
                                                 adam_beta1=0.9, adam_beta2=0.95), [model], ParallelState.single())
    sched = OptimizerParamScheduler(opt, 1e-3, 1e-4, 2, 10, "cosine", 0.01)
    return model, opt, sched


def _train(model, opt, sched, first: int, count: int) -> torch.Tensor:
    data = _golden()["data"]  # [iterations, micro batch, seq + 1]: the fixture run's batches
    pos = torch.arange(data.shape[2] - 1).unsqueeze(0).expand(data.shape[1], -1)
    model.train()
    losses = []
    for it in range(first, first + count):
        loss = model(data[it, :, :-1], pos, labels=data[it, :, 1:]).float().mean()
        opt.zero_grad()
        loss.backward()
        assert opt.step()[0]
        sched.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_load_resumes_a_megatron_lm_checkpoint_on_megatron_cores_curve(capsys):
    model, opt, sched = _run_state()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    iteration, consumed = checkpointing.load_checkpoint([model], opt, sched, _cfg(FIXTURE), ParallelState.single())
    assert (iteration, consumed, sched.num_steps) == (3, 6, 3)
    assert "Megatron-LM checkpoint" in capsys.readouterr().out
    # the RNG streams are the saved ones (data-parallel rank 0's)
    r = load_megatron_file(RAW)["rng_state"][0]
    assert random.getstate() == r["random_rng_state"]
    assert torch.equal(torch.get_rng_state(), r["torch_rng_state"])
    # the data position carries over (consumed samples / global batch); bf16, within 1e-3 of the losses Megatron-Core
    # logs when it resumes the same checkpoint with its own optimizer (fixtures/make_megatron_resume_golden.py)
    got = _train(model, opt, sched, consumed // 2, 10)
    mcore = json.load(open(os.path.join(FIXTURE, "megatron_core_resume.json")))
    assert mcore["first_iteration"] == consumed // 2
    want = torch.tensor(mcore["losses"])
    assert (got - want).abs().max().item() < 1e-3, (got, want)


def test_no_load_optim_and_finetune_load_the_model_only():
    want = _golden()["resumed_losses"]
    model, opt, sched = _run_state()
    iteration, consumed = checkpointing.load_checkpoint([model], opt, sched, _cfg(FIXTURE, no_load_optim=True),
                                                        ParallelState.single())
    assert (iteration, consumed, sched.num_steps) == (3, 6, 0)
    assert not any(opt.optimizer.state.values())  # Adam moments untouched
    got = _train(model, opt, sched, 3, 1)
    assert abs(got[0].item() - want[0].item()) < 1e-3  # same weights: Megatron-Core's first loss

    model, opt, sched = _run_state()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    assert checkpointing.load_checkpoint([model], opt, sched, _cfg(FIXTURE, finetune=True),
                                         ParallelState.single()) == (0, 0)
    assert sched.num_steps == 0 and torch.equal(torch.get_rng_state(), before)  # no RNG, no optimizer
    got = _train(model, opt, sched, 3, 10)
    assert (got - want).abs().max().item() > 1e-2  # a fresh optimizer and schedule leave the curve


def test_torch_dist_loads_with_no_load_optim_and_names_the_flag_otherwise(capsys):
    model, opt, sched = _run_state()
    with pytest.raises(checkpointing.CheckpointError, match="torch_dist.*--no-load-optim"):
        checkpointing.load_checkpoint([model], opt, sched, _cfg(DIST_FIXTURE), ParallelState.single())
    iteration, consumed = checkpointing.load_checkpoint([model], opt, sched, _cfg(DIST_FIXTURE, no_load_optim=True),
                                                        ParallelState.single())
    assert (iteration, consumed) == (3, 6)
    assert "RNG state not restored" in capsys.readouterr().out
    got = _train(model, opt, sched, 3, 1)
    assert abs(got[0].item() - _golden()["resumed_losses"][0].item()) < 1e-3


def test_a_model_of_other_sizes_is_one_line_naming_the_folder():
    dims = dims_from_args(read_megatron_checkpoint(FIXTURE, load_optim=False, load_rng=False).args_dict)
    from dataclasses import replace

    model = build_stage(replace(dims, ffn_hidden_size=32), ParallelState.single(), dtype=torch.bfloat16)
    with pytest.raises(checkpointing.CheckpointError) as info:
        checkpointing.load_checkpoint([model], None, None, _cfg(FIXTURE, no_load_rng=True), ParallelState.single())
    message = str(info.value)
    assert "\n" not in message and FIXTURE in message and "does not fit this model" in message


@pytest.mark.parametrize("root", [FIXTURE, DIST_FIXTURE], ids=["legacy", "torch_dist"])
def test_use_checkpoint_args_takes_the_model_flags_from_a_megatron_lm_checkpoint(root):
    from megatron.training.arguments import parse_config

    cfg, _ = parse_config(["--mock-data", "--load", root, "--use-checkpoint-args", "--micro-batch-size", "2",
                           "--global-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length) == (2, 64, 4, 64, 16)
    assert m.make_vocab_size_divisible_by == 64 and m.norm_epsilon == 1e-5
    assert (cfg.data.tokenizer_type, cfg.data.vocab_size) == ("NullTokenizer", 64)  # Megatron-LM's --vocab-size


# ---- the distributed optimizer's distrib_optim.pt (fixtures/make_megatron_distopt_fixture.py) ----------------------
DISTOPT_FIXTURE = os.path.join(os.path.dirname(FIXTURE), "megatron_gpt_distopt")


def test_distrib_optim_is_read_by_parameter_name():
    """Each parameter's fp32 main copy, cut from the flat bucket-coalesced buffers (64-element alignment, several
    buckets), rounds to exactly that parameter's bf16 weight, which Megatron-Core copied from it."""
    ckpt = read_megatron_checkpoint(DISTOPT_FIXTURE)
    named, meta = ckpt.extra["optimizer_by_name"][(0, 0)]
    assert meta["kind"] == "distributed" and meta["step"] == 3.0
    assert [g["weight_decay"] for g in meta["param_groups"]] == [0.01, 0.0]
    weights = ckpt.model_state_per_rank[(0, 0)][0]
    assert set(named[0]) == set(weights)
    for name, entry in named[0].items():
        assert entry["param"].dtype == torch.float32 and entry["param"].shape == weights[name].shape
        torch.testing.assert_close(entry["param"].to(torch.bfloat16), weights[name], atol=0, rtol=0, msg=name)
        assert entry["exp_avg_sq"].min() >= 0 and entry["exp_avg_sq"].max() > 0, name


def _distopt_resume(no_load_optim: bool):
    from megatron.core.distributed import DDPConfig, DistributedDataParallel

    dims = dims_from_args(read_megatron_checkpoint(DISTOPT_FIXTURE, load_optim=False, load_rng=False).args_dict)
    pstate = ParallelState.build(1, 1)
    model = build_stage(dims, pstate, dtype=torch.bfloat16, seed=5)
    ddp = DistributedDataParallel(model, pstate=pstate, config=DDPConfig(use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, weight_decay=0.01, clip_grad=1.0,
                                                 adam_beta1=0.9, adam_beta2=0.95, use_distributed_optimizer=True),
                                 [ddp], pstate)
    sched = OptimizerParamScheduler(opt, 1e-3, 1e-4, 2, 10, "cosine", 0.01)
    cfg = _cfg(DISTOPT_FIXTURE, no_load_rng=True, no_load_optim=no_load_optim)
    iteration, consumed = checkpointing.load_checkpoint([ddp], opt, sched, cfg, pstate)
    steps = sched.num_steps
    data = torch.load(os.path.join(DISTOPT_FIXTURE, "golden.pt"), weights_only=True)["data"]  # [it, 4, seq + 1]
    pos = torch.arange(data.shape[2] - 1).unsqueeze(0).expand(data.shape[1], -1)
    losses = []
    model.train()
    for it in range(consumed // 4, consumed // 4 + 10):  # the whole global batch of 4 in one micro-batch
        opt.zero_grad()
        loss = ddp(data[it, :, :-1], pos, labels=data[it, :, 1:]).float().mean()
        loss.backward()
        assert opt.step()[0]
        sched.step()
        losses.append(loss.item())
    return {"iteration": iteration, "consumed": consumed, "steps": steps, "losses": torch.tensor(losses)}


def _distopt_body(rank, world, out):
    torch.save({"full": _distopt_resume(False), "no_optim": _distopt_resume(True)}, out)


def test_distributed_optimizer_checkpoint_resumes_on_megatron_cores_curve(tmp_path):
    """Megatron-Core's own DDP + DistributedOptimizer (DP=2, bf16) saved at iteration 3 and continued ten
    iterations; our distributed optimizer (one process, the same global batch) loads the checkpoint through
    --load and reproduces those losses (bf16, within 1e-3)."""
    from tests.dist_utils import run_distributed

    out = str(tmp_path / "got.pt")
    run_distributed(_distopt_body, world_size=1, args=(out,))
    results = torch.load(out, weights_only=True)
    got = results["full"]
    assert (got["iteration"], got["consumed"], got["steps"]) == (3, 12, 3)
    want = torch.load(os.path.join(DISTOPT_FIXTURE, "golden.pt"), weights_only=True)["resumed_losses"]
    assert (got["losses"] - want).abs().max().item() < 1e-3, (got["losses"], want)
    # without the optimizer state (moments, fp32 main params, schedule position) the curve is far off
    assert (results["no_optim"]["losses"] - want).abs().max().item() > 1e-2


def test_converter_carries_distrib_optim_state_through_ours_tp2_and_back(tmp_path, capsys):
    from megatron.core.checkpoint_formats import read_our_checkpoint
    from tests.unit.checkpoint.test_convert import _run

    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                        DISTOPT_FIXTURE, "--save-dir", ours, "--target-tensor-parallel-size", "2",
                        "--reshard-optimizer")
    assert rc == 0, err
    assert read_our_checkpoint(ours).optimizer[(1, 0)]["distributed_optimizer"]  # the source's wrapper
    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "ours", "--saver", "megatron", "--load-dir", ours,
                        "--save-dir", back, "--target-tensor-parallel-size", "1", "--reshard-optimizer",
                        "--true-vocab-size", "64")
    assert rc == 0, err
    want, _ = read_megatron_checkpoint(DISTOPT_FIXTURE).extra["optimizer_by_name"][(0, 0)]
    got, meta = read_megatron_checkpoint(back).extra["optimizer_by_name"][(0, 0)]
    assert meta["step"] == 3.0 and set(got[0]) == set(want[0])
    for name, entry in want[0].items():
        for key, value in entry.items():
            torch.testing.assert_close(got[0][name][key], value, atol=0, rtol=0, msg=f"{name} {key}")


def test_distrib_optim_missing_or_in_an_older_layout_is_one_line(tmp_path):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(DISTOPT_FIXTURE, root)
    distrib = root / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt"
    torch.save({0: {}}, distrib)  # per-bucket files of older Megatron-Core releases lack "buckets_coalesced"
    with pytest.raises(Exception, match="bucket-coalesced layout"):
        read_megatron_checkpoint(str(root))
    distrib.unlink()
    with pytest.raises(Exception, match="distrib_optim.pt is missing.*--no-load-optim"):
        read_megatron_checkpoint(str(root))
    model, opt, sched = _run_state(root=DISTOPT_FIXTURE)
    with pytest.raises(checkpointing.CheckpointError, match="distrib_optim.pt is missing"):
        checkpointing.load_checkpoint([model], opt, sched, _cfg(str(root), no_load_rng=True), ParallelState.single())
    assert checkpointing.load_checkpoint([model], opt, sched, _cfg(str(root), no_load_rng=True, no_load_optim=True),
                                         ParallelState.single()) == (3, 12)


def test_buffer_offsets_match_megatron_cores_grad_buffer():
    """Offsets in the flat tensors for alignment, bucket cuts and the tied embedding's own bucket, against
    Megatron-Core's ``_ParamAndGradBuffer`` (fixtures/make_distopt_offsets_golden.py)."""
    from megatron.core.checkpoint_formats.distrib_optim import buffer_offsets

    cases = json.load(open(os.path.join(os.path.dirname(FIXTURE), "distopt_offsets.json")))
    assert len(cases) == 7 and {c["buckets"] for c in cases} >= {1, 2, 6}
    for case in cases:
        params = [(f"p{i}", n) for i, n in enumerate(case["sizes"])]
        offsets, length = buffer_offsets(params, case["bucket_size"], tuple(f"p{i}" for i in case["shared"]))
        assert [offsets[n] for n, _ in params] == case["offsets"], case
        assert length == case["numel_unpadded"], case


def _megatron_tp2_body(rank, world, out):
    from dataclasses import replace

    dims = dims_from_args(read_megatron_checkpoint(FIXTURE, load_optim=False, load_rng=False).args_dict)
    # this run keeps the saved 64 embedding rows at TP=2 (--padded-vocab-size 64), so the loss is comparable
    dims = replace(dims, vocab_size=None, padded_vocab_size=64)
    pstate = ParallelState.build(tensor_model_parallel_size=world)
    model = build_stage(dims, pstate, dtype=torch.bfloat16, seed=5)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, weight_decay=0.01, clip_grad=0.0,
                                                 adam_beta1=0.9, adam_beta2=0.95), [model], pstate)
    sched = OptimizerParamScheduler(opt, 1e-3, 1e-4, 2, 10, "cosine", 0.01)
    result = checkpointing.load_checkpoint([model], opt, sched, _cfg(FIXTURE), pstate)
    losses = _train(model, opt, sched, result[1] // 2, 10)
    if rank == 0:
        torch.save({"result": result, "losses": losses}, out)


def test_megatron_lm_checkpoint_resumes_at_tp2_resharded_at_load(tmp_path, capfd):
    """The TP=1 Megatron-LM checkpoint loaded by a TP=2 run: model and mixed-precision optimizer resharded at load,
    RNG not restored (one note); the next ten losses still follow Megatron-Core's resume (bf16, within 1e-3)."""
    from tests.dist_utils import run_distributed

    out = str(tmp_path / "tp2.pt")
    run_distributed(_megatron_tp2_body, world_size=2, args=(out,))
    printed = capfd.readouterr().out
    assert "saved at TP=1, PP=1) to TP=2, PP=1" in printed and "RNG state not restored" in printed
    got = torch.load(out, weights_only=True)
    assert tuple(got["result"]) == (3, 6)
    want = torch.tensor(json.load(open(os.path.join(FIXTURE, "megatron_core_resume.json")))["losses"])
    assert (got["losses"] - want).abs().max().item() < 1e-3, (got["losses"], want)


def test_ckpt_format_torch_dist_saves_what_the_trainer_resumes_exactly(tmp_path):
    """``--ckpt-format torch_dist``: the Megatron-LM fixture's run resumed here, trained one iteration and saved as
    torch_dist (the writer Megatron-Core 0.16.1 loads, fixtures/check_our_torch_dist_in_megatron_core.py); a fresh
    model, optimizer and scheduler loaded from it continue with the same losses as the run that saved it."""
    from megatron.core.tensor_parallel import get_all_rng_states

    model, opt, sched = _run_state()
    checkpointing.load_checkpoint([model], opt, sched, _cfg(FIXTURE, no_load_rng=True), ParallelState.single())
    _train(model, opt, sched, 3, 1)
    save = str(tmp_path / "td")
    args = dict(read_megatron_checkpoint(FIXTURE, load_optim=False, load_rng=False).args_dict,
                train_iters=10, lr_warmup_iters=2)
    checkpointing.save_checkpoint(4, [model], opt, sched, _cfg(None, save=save, ckpt_format="torch_dist"),
                                  ParallelState.single(), 8, args)
    assert sorted(os.listdir(os.path.join(save, "iter_0000004")))[:2] == [".metadata", "__0_0.distcp"]
    rng = get_all_rng_states()
    want = _train(model, opt, sched, 4, 3)
    model2, opt2, sched2 = _run_state(seed=11)
    assert checkpointing.load_checkpoint([model2], opt2, sched2, _cfg(save), ParallelState.single()) == (4, 8)
    assert torch.equal(get_all_rng_states()["torch_cpu"], rng["torch_cpu"]) and sched2.num_steps == 4
    got = _train(model2, opt2, sched2, 4, 3)
    assert torch.equal(got, want), (got, want)
