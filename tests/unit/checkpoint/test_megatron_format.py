"""Reading and writing Megatron-LM legacy checkpoints, against a fixture written by Megatron-Core's own code
(tests/unit/checkpoint/fixtures/make_megatron_fixture.py says how it was made)."""

import json
import os
import pickle
import random
import warnings

import numpy as np
import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.checkpoint_io import CheckpointIOError
from megatron.core.checkpoint_formats import (CheckpointFormatError, dims_from_args, load_megatron_file,
                                              merge_tp_pp, read_megatron_checkpoint, write_megatron_checkpoint)
from megatron.core.checkpoint_formats.optimizer_state import grouped_order
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from megatron.training.scheduler import OptimizerParamScheduler
from tests.unit.checkpoint.helpers import FIXTURE, build_stage

RAW = os.path.join(FIXTURE, "iter_0000003", "mp_rank_00", "model_optim_rng.pt")


def _golden():
    return torch.load(os.path.join(FIXTURE, "golden.pt"), weights_only=True)


def test_safe_reader_needs_only_the_allowlist():
    needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(RAW))
    assert needed == {"argparse.Namespace", "numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
                      "megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend"}
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(RAW, weights_only=True)  # what a plain weights-only load says
    state = load_megatron_file(RAW)
    assert str(state["args"].model_type) == "ModelType.encoder_or_decoder"
    assert str(state["args"].attention_backend) == "AttnBackend.auto"
    assert state["args"].params_dtype is torch.bfloat16


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/_ckpt_exploit_ran",))


def test_refuses_a_file_needing_another_global(tmp_path):
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": {"a": 1}, "payload": _Exploit()}, path, pickle_module=pickle)
    if os.path.exists("/tmp/_ckpt_exploit_ran"):
        os.remove("/tmp/_ckpt_exploit_ran")
    with pytest.raises(CheckpointFormatError) as err:
        load_megatron_file(path)
    assert "posix.system" in str(err.value) or "os.system" in str(err.value)
    assert "\n" not in str(err.value)
    assert not os.path.exists("/tmp/_ckpt_exploit_ran")
    with open(path, "rb") as f:
        head = f.read(100)
    with open(path, "wb") as f:  # a truncated file: one line saying so
        f.write(head)
    with pytest.raises(CheckpointFormatError, match=r"model_optim_rng.pt is not a complete torch file \(truncated or "
                       r"of another kind: PytorchStreamReader failed reading zip archive: [^.\n]*\)$"):
        load_megatron_file(path)


def test_megatron_model_gives_megatron_core_logits():
    ckpt = read_megatron_checkpoint(FIXTURE)
    assert ckpt.iteration == 3 and ckpt.consumed_samples == 6
    dims = dims_from_args(ckpt.args_dict)
    full = {k: v.float() for k, v in merge_tp_pp(ckpt.model_state_per_rank).items()}
    model = build_stage(dims, ParallelState.single(), full)  # strict load: same names and shapes
    golden = _golden()
    tokens = golden["tokens"]
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, pos)
    torch.testing.assert_close(logits, golden["logits"], atol=1e-5, rtol=1e-5)


def test_optimizer_maps_into_our_parameter_order_and_loads():
    raw = load_megatron_file(RAW)
    golden_order = _golden()["param_order"]  # Megatron-Core's own groups, by parameter name
    mg_main = {n: t for names, ts in zip(golden_order, raw["optimizer"]["fp32_from_fp16_params"])
               for n, t in zip(names, ts)}
    mg_state, pid = {}, 0
    for names in golden_order:
        for n in names:
            mg_state[n] = raw["optimizer"]["optimizer"]["state"][pid]
            pid += 1
    ckpt = read_megatron_checkpoint(FIXTURE)
    dims = dims_from_args(ckpt.args_dict)
    model = build_stage(dims, ParallelState.single(), ckpt.model_state_per_rank[(0, 0)][0], dtype=torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, weight_decay=0.01), [model],
                                 ParallelState.single())
    opt.load_state_dict(ckpt.optimizer[(0, 0)])
    names = {id(p): n for n, p in model.named_parameters()}
    for i, (param, main) in enumerate(zip(opt.model_params, opt.main_params)):
        name = names[id(param)]
        torch.testing.assert_close(main.detach(), mg_main[name], atol=0, rtol=0)
        st = opt.optimizer.state[main]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[key], mg_state[name][key], atol=0, rtol=0)
        assert float(st["step"]) == 3.0
        # the bf16 model weight is the rounded fp32 main weight Megatron saved next to it
        torch.testing.assert_close(param.detach(), mg_main[name].to(torch.bfloat16), atol=0, rtol=0)
    assert len(opt.main_params) == sum(len(n) for n in golden_order)


def test_scheduler_position_and_rng_carry_over():
    raw = load_megatron_file(RAW)
    ckpt = read_megatron_checkpoint(FIXTURE)
    assert ckpt.scheduler["num_steps"] == 3  # 6 samples at global batch 2
    sched = OptimizerParamScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0), max_lr=1e-3,
                                    min_lr=1e-4, warmup_steps=ckpt.scheduler["warmup_steps"],
                                    decay_steps=ckpt.scheduler["decay_steps"],
                                    decay_style=ckpt.scheduler["decay_style"], weight_decay=0.01)
    sched.load_state_dict(ckpt.scheduler)
    megatron_lr = raw["optimizer"]["optimizer"]["param_groups"][0]["lr"]  # set by Megatron-Core's scheduler
    assert sched.get_lr() == pytest.approx(megatron_lr, rel=1e-9)

    r = raw["rng_state"][0]
    random.setstate(r["random_rng_state"])
    np.random.set_state(r["np_rng_state"])
    torch.set_rng_state(r["torch_rng_state"])
    want = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    tensor_parallel.set_all_rng_states(ckpt.rng[(0, 0)])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1]
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)


def test_write_megatron_matches_megatron_layout_and_reads_back(tmp_path):
    ckpt = read_megatron_checkpoint(FIXTURE)
    dims = dims_from_args(ckpt.args_dict)
    named = ckpt.extra["optimizer_by_name"]
    out = str(tmp_path / "mg")
    write_megatron_checkpoint(out, ckpt.model_state_per_rank, dims, ckpt.args_dict, iteration=ckpt.iteration,
                              consumed_samples=ckpt.consumed_samples, optimizer_by_name=named,
                              scheduler=ckpt.scheduler, rng=ckpt.rng)
    raw = load_megatron_file(RAW)
    new = load_megatron_file(os.path.join(out, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    assert list(new["model"]) == list(raw["model"])  # Megatron-Core's order and _extra_state entries
    for k, v in raw["model"].items():
        if v is None:
            assert new["model"][k] is None
        else:
            torch.testing.assert_close(new["model"][k], v, atol=0, rtol=0)
    assert new["opt_param_scheduler"] == raw["opt_param_scheduler"]
    for a, b in zip(new["optimizer"]["fp32_from_fp16_params"], raw["optimizer"]["fp32_from_fp16_params"]):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
    for pid, st in raw["optimizer"]["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(new["optimizer"]["optimizer"]["state"][pid][key], st[key], atol=0, rtol=0)
    assert new["args"].consumed_train_samples == 6 and new["iteration"] == 3
    # every saved argument is kept except Megatron's enum values, which would need Megatron's classes to pickle
    assert set(vars(raw["args"])) - set(vars(new["args"])) == {"model_type", "attention_backend"}
    r_new, r_raw = new["rng_state"][0], raw["rng_state"][0]
    assert r_new["random_rng_state"] == r_raw["random_rng_state"]
    assert np.array_equal(r_new["np_rng_state"][1], r_raw["np_rng_state"][1])
    again = read_megatron_checkpoint(out)
    assert again.scheduler == ckpt.scheduler and again.consumed_samples == 6
    assert grouped_order(again.model_state_per_rank[(0, 0)]) == grouped_order(ckpt.model_state_per_rank[(0, 0)])


def test_refuses_missing_tracker_and_incomplete_torch_dist(tmp_path):
    with pytest.raises(CheckpointIOError, match="latest_checkpointed_iteration.txt"):
        read_megatron_checkpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    it = tmp_path / "iter_0000005"
    it.mkdir()
    (it / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="no .metadata"):
        read_megatron_checkpoint(str(tmp_path))


def test_torch_dist_checkpoint_gives_the_legacy_weights_and_first_loss():
    """The fixture run's iteration 3 saved by Megatron-Core's torch_dist writer
    (fixtures/make_megatron_torch_dist_fixture.py): same weights as the legacy file, so the same first loss."""
    dist_root = os.path.join(os.path.dirname(FIXTURE), "megatron_gpt_dist")
    ckpt = read_megatron_checkpoint(dist_root)
    assert ckpt.extra["format"] == "torch_dist" and ckpt.optimizer is None
    assert ckpt.iteration == 3 and ckpt.consumed_samples == 6 and ckpt.args_dict["num_layers"] == 2
    legacy = merge_tp_pp(read_megatron_checkpoint(FIXTURE).model_state_per_rank)
    full = ckpt.model_state_per_rank[(0, 0)][0]
    assert list(full) == list(legacy) and all(torch.equal(full[k], legacy[k]) for k in legacy)
    dims = dims_from_args(ckpt.args_dict)
    model = build_stage(dims, ParallelState.single(), full, dtype=torch.bfloat16)
    data = _golden()["data"]
    pos = torch.arange(data.shape[2] - 1).unsqueeze(0).expand(data.shape[1], -1)
    with torch.no_grad():
        loss = model(data[3, :, :-1], pos, labels=data[3, :, 1:]).float().mean()
    assert abs(loss.item() - _golden()["resumed_losses"][0].item()) < 1e-3  # Megatron-Core's loss at that step


def test_torch_dist_metadata_is_unpickled_through_an_allowlist(tmp_path):
    from megatron.core.checkpoint_formats.megatron_dist import read_dcp_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointFormatError, match="system"):
        read_dcp_metadata(str(tmp_path))
    assert not os.path.exists("/tmp/_ckpt_exploit_ran")


def test_megatron_lm_torch_dist_with_mcore_metadata_gives_the_distributed_optimizer_by_name():
    """Megatron-Core 0.15's own torch_dist writer (fixtures/make_megatron_torch_dist_optim_fixture.py) pickles its
    ``MCoreMetadata`` into ``.metadata``: it is read through a data-only stand-in, and the distributed optimizer's
    dp_reshardable buckets give each parameter's fp32 main copy (which rounds to exactly the bf16 weight
    Megatron-Core copied from it) and Adam moments; scheduler (samples -> iterations) and RNG carry over."""
    from megatron.core.checkpoint_formats.megatron_dist import MCoreMetadata, read_dcp_metadata

    root = os.path.join(os.path.dirname(FIXTURE), "megatron_gpt_torch_dist")
    assert type(read_dcp_metadata(os.path.join(root, "iter_0000003"))) is MCoreMetadata
    ckpt = read_megatron_checkpoint(root)
    assert (ckpt.iteration, ckpt.consumed_samples, ckpt.scheduler["num_steps"]) == (3, 12, 3)
    named, meta = ckpt.extra["optimizer_by_name"][(0, 0)]
    assert meta["kind"] == "distributed" and meta["step"] == 3.0
    assert [g["weight_decay"] for g in meta["param_groups"]] == [0.01, 0.0]
    weights = ckpt.model_state_per_rank[(0, 0)][0]
    assert set(named[0]) == set(weights) and len(weights) == 28
    for name, entry in named[0].items():
        torch.testing.assert_close(entry["param"].to(torch.bfloat16), weights[name], atol=0, rtol=0, msg=name)
        assert entry["exp_avg_sq"].min() >= 0 and entry["exp_avg_sq"].max() > 0, name
    assert ckpt.optimizer[(0, 0)]["distributed_optimizer"] and ckpt.rng[(0, 0)]["random"][0] == 3
    without = read_megatron_checkpoint(root, load_optim=False, load_rng=False)
    assert without.optimizer is None and without.rng is None and without.scheduler is None


def test_our_torch_dist_writer_round_trips_megatron_lms_checkpoint(tmp_path, capsys):
    """``convert.py --saver torch_dist`` rewrites Megatron-LM's torch_dist checkpoint (weights, the distributed
    optimizer's buckets, scheduler, RNG) and reading it back gives every tensor unchanged. (Megatron-Core 0.16.1
    loads this writer's output with strict key checking and gives its golden logits exactly:
    fixtures/check_our_torch_dist_in_megatron_core.py, result in megatron_gpt/megatron_core_loads_our_torch_dist.json.)"""
    from tests.unit.checkpoint.test_convert import _run

    root = os.path.join(os.path.dirname(FIXTURE), "megatron_gpt_torch_dist")
    out = str(tmp_path / "td")
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "torch_dist", "--load-dir",
                      root, "--save-dir", out, "--reshard-optimizer")
    assert rc == 0, err
    a, b = read_megatron_checkpoint(root), read_megatron_checkpoint(out)
    assert (b.iteration, b.consumed_samples, b.scheduler) == (a.iteration, a.consumed_samples, a.scheduler)
    wa, wb = a.model_state_per_rank[(0, 0)][0], b.model_state_per_rank[(0, 0)][0]
    assert list(wa) == list(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    (na, ma), (nb, mb) = a.extra["optimizer_by_name"][(0, 0)], b.extra["optimizer_by_name"][(0, 0)]
    assert mb["step"] == ma["step"] == 3.0
    assert all(gb[k] == v for ga, gb in zip(ma["param_groups"], mb["param_groups"]) for k, v in ga.items())
    for name, entry in na[0].items():
        for key, value in entry.items():
            assert torch.equal(nb[0][name][key], value), (name, key)
    assert torch.equal(b.rng[(0, 0)]["torch_cpu"], a.rng[(0, 0)]["torch_cpu"])
    assert json.load(open(os.path.join(FIXTURE, "megatron_core_loads_our_torch_dist.json")))[
        "max_abs_logit_difference"] < 1e-5


def test_torch_dist_sharded_objects_are_unpickled_through_the_allowlist(tmp_path):
    """A sharded object (here ``rng_state``) whose bytes need a code-running global is refused by name, never run
    (torch's own reader would unpickle it with ``weights_only=False``)."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    it = tmp_path / "iter_0000001"
    it.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        save({"embedding.word_embeddings.weight": torch.zeros(4, 2), "rng_state/shard_0.0_1.1": [_Exploit()]},
             storage_writer=FileSystemWriter(str(it)), planner=DefaultSavePlanner(flatten_state_dict=False),
             no_dist=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(CheckpointFormatError, match="rng_state.*system"):
        read_megatron_checkpoint(str(tmp_path), load_optim=False)
    assert not os.path.exists("/tmp/_ckpt_exploit_ran")


def _resume(ckpt, dims, load_optimizer: bool):
    """Continue the fixture's run for ten iterations on its data, from the consumed-samples position."""
    golden = _golden()
    model = build_stage(dims, ParallelState.single(), ckpt.model_state_per_rank[(0, 0)][0], dtype=torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, weight_decay=0.01, clip_grad=0.0,
                                                 adam_beta1=0.9, adam_beta2=0.95), [model], ParallelState.single())
    if load_optimizer:
        opt.load_state_dict(ckpt.optimizer[(0, 0)])
    sched = OptimizerParamScheduler(opt, 1e-3, 1e-4, ckpt.scheduler["warmup_steps"], ckpt.scheduler["decay_steps"],
                                    ckpt.scheduler["decay_style"], ckpt.scheduler["weight_decay"])
    sched.load_state_dict(ckpt.scheduler)
    data = golden["data"]  # [iterations, micro batch, seq + 1]
    first = ckpt.consumed_samples // ckpt.args_dict["global_batch_size"]  # the data position carries over
    pos = torch.arange(data.shape[2] - 1).unsqueeze(0).expand(data.shape[1], -1)
    model.train()
    losses = []
    for it in range(first, first + 10):
        loss = model(data[it, :, :-1], pos, labels=data[it, :, 1:]).float().mean()
        opt.zero_grad()
        loss.backward()
        assert opt.step()[0]
        sched.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_resume_reproduces_megatron_core_continuation():
    """bf16: model, fp32 main params, Adam moments, scheduler and data position all carry over; the ten losses
    after the resume match Megatron-Core's own continuation of the run (a resume without the optimizer state
    is far off, so the comparison is sensitive to it)."""
    ckpt = read_megatron_checkpoint(FIXTURE)
    dims = dims_from_args(ckpt.args_dict)
    want = _golden()["resumed_losses"]
    got = _resume(ckpt, dims, load_optimizer=True)
    assert (got - want).abs().max().item() < 1e-3, (got, want)
    fresh = _resume(ckpt, dims, load_optimizer=False)
    assert (fresh - want).abs().max().item() > 1e-2


def _distributed_body(rank, world, out):
    from megatron.core.checkpoint_formats import read_megatron_checkpoint as read
    from megatron.core.checkpoint_formats.optimizer_state import named_to_ours
    from megatron.core.distributed import DDPConfig, DistributedDataParallel

    ckpt = read(FIXTURE)
    dims = dims_from_args(ckpt.args_dict)
    pstate = ParallelState.build(1, 1)
    chunks = ckpt.model_state_per_rank[(0, 0)]
    model = build_stage(dims, pstate, chunks[0], dtype=torch.bfloat16)
    ddp = DistributedDataParallel(model, pstate=pstate, config=DDPConfig(use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, use_distributed_optimizer=True), [ddp], pstate)
    named, meta = ckpt.extra["optimizer_by_name"][(0, 0)]
    opt.load_state_dict(named_to_ours(named, meta, chunks, kind="distributed"))
    state = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    torch.save({n: entry for n, entry in zip(names, state["params"])}, out)


def test_megatron_optimizer_loads_into_our_distributed_optimizer(tmp_path):
    from tests.dist_utils import run_distributed

    out = str(tmp_path / "distopt.pt")
    run_distributed(_distributed_body, world_size=1, args=(out,))
    got = torch.load(out, weights_only=True)
    raw = load_megatron_file(RAW)
    order = _golden()["param_order"]
    pid = 0
    for g, names in enumerate(order):
        for j, name in enumerate(names):
            torch.testing.assert_close(got[name]["param"], raw["optimizer"]["fp32_from_fp16_params"][g][j], atol=0,
                                       rtol=0)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got[name][key], raw["optimizer"]["optimizer"]["state"][pid][key], atol=0,
                                           rtol=0)
            pid += 1
    assert len(got) == pid


def test_megatron_core_tp2_shards_merge_into_the_same_model():
    """Shards cut by Megatron-Core's own tensor-parallel layers (fixtures/make_megatron_tp2_fixture.py) merge into
    a model whose single-process logits equal Megatron-Core's TP=2 forward pass."""
    root = os.path.join(os.path.dirname(FIXTURE), "megatron_gpt_tp2")
    ckpt = read_megatron_checkpoint(root)
    assert sorted(ckpt.model_state_per_rank) == [(0, 0), (1, 0)] and ckpt.iteration == 0
    shard = ckpt.model_state_per_rank[(1, 0)][0]
    assert shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (96, 64)
    assert shard["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 32)
    assert ckpt.optimizer is None and ckpt.scheduler is None
    dims = dims_from_args(ckpt.args_dict)
    full = merge_tp_pp(ckpt.model_state_per_rank)
    model = build_stage(dims, ParallelState.single(), full)
    golden = torch.load(os.path.join(root, "golden.pt"), weights_only=True)
    tokens = golden["tokens"]
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, pos)
    torch.testing.assert_close(logits, golden["logits"], atol=1e-5, rtol=1e-5)


def test_refuses_architectures_and_the_wrong_reader(tmp_path):
    from megatron.core.checkpoint_formats import read_our_checkpoint
    from megatron.core.checkpoint_formats.layout import check_supported_args

    for key, value, flag in (("num_experts", 8, "--num-experts 8"), ("multi_latent_attention", True,
                                                                     "--multi-latent-attention True")):
        with pytest.raises(CheckpointFormatError, match=flag):
            check_supported_args({key: value}, "f.pt")
    check_supported_args({"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
                          "add_bias_linear": False, "num_experts": None, "transformer_impl": "local"}, "f.pt")
    with pytest.raises(CheckpointFormatError) as err:
        read_our_checkpoint(FIXTURE)
    assert str(err.value).endswith(  # one clean line: no torch advice, no terminal escape codes
        "mp_rank_00/model_optim_rng.pt is not a checkpoint of this framework (it needs unpickling beyond tensors and "
        "plain types: argparse.Namespace); a Megatron-LM checkpoint is read with --loader megatron"), str(err.value)
    ckpt = read_megatron_checkpoint(FIXTURE)
    out = str(tmp_path / "ours")
    from megatron.core.checkpoint_formats import write_our_checkpoint

    write_our_checkpoint(out, ckpt.model_state_per_rank, dims_from_args(ckpt.args_dict), ckpt.args_dict)
    with pytest.raises(CheckpointFormatError, match="--loader ours"):
        read_megatron_checkpoint(out)


def _tp2_load_body(rank, world, out):
    from megatron.core.checkpoint_formats import state_for_rank

    ckpt = read_megatron_checkpoint(FIXTURE)
    dims = dims_from_args(ckpt.args_dict)
    chunks, opt_state, rng = state_for_rank(ckpt, dims, world, 1, rank, 0, optimizer_kind="mixed")
    assert rng is None  # the saved RNG streams belong to TP=1
    pstate = ParallelState.build(tensor_model_parallel_size=world)
    model = build_stage(dims, pstate, {k: v.float() for k, v in chunks[0].items()})
    tokens = _golden()["tokens"]
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        local = model(tokens, pos)  # [b, s, 128/2]
    parts = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(parts, local.contiguous(), group=pstate.tp_group)
    bf16 = build_stage(dims, pstate, chunks[0], dtype=torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True), [bf16], pstate)
    opt.load_state_dict(opt_state)
    names = {id(p): n for n, p in bf16.named_parameters()}
    mains = {names[id(p)]: m.detach() for p, m in zip(opt.model_params, opt.main_params)}
    if rank == 0:
        torch.save({"logits": torch.cat(parts, dim=-1)}, out)
    torch.save(mains, f"{out}.mains{rank}")


def test_state_for_rank_reshards_megatron_to_tp2_at_load_time(tmp_path):
    from tests.dist_utils import run_distributed

    out = str(tmp_path / "tp2.pt")
    run_distributed(_tp2_load_body, world_size=2, args=(out,))
    logits = torch.load(out, weights_only=True)["logits"]
    assert logits.shape[-1] == 128  # 64 tokens padded for TP=2 (--make-vocab-size-divisible-by 64)
    torch.testing.assert_close(logits[..., :64], _golden()["logits"], atol=1e-5, rtol=1e-5)
    raw = load_megatron_file(RAW)
    order = _golden()["param_order"]
    main = {n: t for names, ts in zip(order, raw["optimizer"]["fp32_from_fp16_params"]) for n, t in zip(names, ts)}
    for rank in range(2):
        got = torch.load(f"{out}.mains{rank}", weights_only=True)
        qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
        assert torch.equal(got[qkv], main[qkv].chunk(2, dim=0)[rank])
        fc2 = "decoder.layers.0.mlp.linear_fc2.weight"
        assert torch.equal(got[fc2], main[fc2].chunk(2, dim=1)[rank])
        ln = "decoder.final_layernorm.weight"
        assert torch.equal(got[ln], main[ln])
