"""TP/PP resharding of model and optimizer state: logits and the next training step are preserved."""

import os
from dataclasses import asdict

import pytest
import torch

from megatron.core.checkpoint_formats import (GPT, CheckpointFormatError, merge_tp_pp, reshard, reshard_named,
                                              split_tp_pp)
from megatron.core.checkpoint_formats.optimizer_state import named_to_ours, ours_to_named
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed
from tests.unit.checkpoint.helpers import (build_stage, pipeline_logits, random_full, single_logits, tiny_dims,
                                           tp_logits_body)

TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))


def _tp_logits(shards, dims, tp, tmp_path):
    out = str(tmp_path / f"logits_tp{tp}.pt")
    run_distributed(tp_logits_body, world_size=tp, args=(asdict(dims), shards, TOKENS, out))
    return torch.load(out, weights_only=True)


def test_tp_1_to_4_to_2_preserves_logits(tmp_path):
    dims = tiny_dims(vocab=100, divisible_by=8)  # padded: 104 at TP=1, 128 at TP=4, 112 at TP=2
    full = random_full(dims)
    want = single_logits(full, dims, TOKENS)
    tp1 = split_tp_pp(full, dims, 1, 1)
    tp4 = reshard(tp1, 1, 1, 4, 1, dims)
    assert tp4[(3, 0)][0]["embedding.word_embeddings.weight"].shape == (32, 32)
    assert tp4[(1, 0)][0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (24, 32)
    assert tp4[(1, 0)][0]["decoder.layers.0.mlp.linear_fc2.weight"].shape == (32, 16)
    tp2 = reshard(tp4, 4, 1, 2, 1, dims)
    for tp, shards in ((4, tp4), (2, tp2)):
        got = _tp_logits(shards, dims, tp, tmp_path)
        assert got.shape[-1] == dims.padded_for(tp)
        torch.testing.assert_close(got[..., :100], want[..., :100], atol=1e-5, rtol=1e-5)
        assert torch.all(got[..., 100:] == 0)  # zero padding rows
    back = merge_tp_pp(reshard(tp2, 2, 1, 1, 1, dims))
    for name, t in full.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("tied", [True, False])
def test_pp_1_to_2_to_1_preserves_logits(tied):
    dims = tiny_dims(layers=4, tied=tied)
    full = random_full(dims)
    want = single_logits(full, dims, TOKENS)
    pp1 = split_tp_pp(full, dims, 1, 1)
    pp2 = reshard(pp1, 1, 1, 1, 2, dims)
    assert sorted(k for k in pp2[(0, 1)][0] if "layers" in k)[0].startswith("decoder.layers.0.")
    assert "output_layer.weight" in pp2[(0, 1)][0]  # the last stage's (tied) output weight
    torch.testing.assert_close(pipeline_logits(pp2, dims, 2, TOKENS), want, atol=1e-5, rtol=1e-5)
    back = reshard(pp2, 1, 2, 1, 1, dims)
    assert list(back[(0, 0)][0]) == list(pp1[(0, 0)][0])
    for name, t in pp1[(0, 0)][0].items():
        assert torch.equal(back[(0, 0)][0][name], t), name


def test_tp2_pp2_merge_is_exact_and_shapes_are_checked():
    dims = tiny_dims(layers=4)
    full = random_full(dims)
    shards = split_tp_pp(full, dims, 2, 2)
    assert len(shards) == 4
    merged = merge_tp_pp(shards)
    assert list(merged) == list(full)
    emb = "embedding.word_embeddings.weight"
    assert merged[emb].shape[0] == 112 and torch.all(merged[emb][100:] == 0)  # padded for TP=2
    assert all(torch.equal(merged[k][:100] if k == emb else merged[k], full[k][:100] if k == emb else full[k])
               for k in full)
    with pytest.raises(CheckpointFormatError, match="attention heads"):
        split_tp_pp(full, dims, 3, 1)
    with pytest.raises(CheckpointFormatError, match="--num-layers"):
        split_tp_pp(full, dims, 1, 3)
    bad = {k: v for k, v in shards[(0, 0)][0].items()}
    bad["decoder.layers.0.self_attention.rotary.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointFormatError, match="rotary"):
        merge_tp_pp({**shards, (0, 0): [bad]})


def _train_step(model, opt, tokens):
    pos = torch.arange(tokens.shape[1] - 1).unsqueeze(0).expand(tokens.shape[0], -1)
    model.train()
    loss = model(tokens[:, :-1], pos, labels=tokens[:, 1:]).float().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _continue_tp_body(rank, world_size, dims_dict, shards, opt_states, batch, out_path):
    from megatron.core.checkpoint_formats import ModelDims

    dims = ModelDims(**dims_dict)
    pstate = ParallelState.build(tensor_model_parallel_size=world_size)
    model = build_stage(dims, pstate, shards[(rank, 0)][0])
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.0), [model], pstate)
    opt.load_state_dict(opt_states[(rank, 0)])
    loss = _train_step(model, opt, batch)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, sd)
    if rank == 0:
        torch.save({"loss": loss, "shards": {(t, 0): [g] for t, g in enumerate(gathered)}}, out_path)


def test_optimizer_reshard_continues_training(tmp_path):
    """Two AdamW steps at TP=1, reshard model + optimizer to TP=2, the third step matches TP=1's.

    The padded vocabulary is 128 at both sizes: the loss's softmax runs over the padding rows too, so a layout
    whose padding differs adds rows and changes the loss (docs/checkpoints.md)."""
    dims = tiny_dims(vocab=100, divisible_by=64)
    batch = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(5))
    model = build_stage(dims, ParallelState.single(), random_full(dims))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.0), [model], ParallelState.single())
    for _ in range(2):
        _train_step(model, opt, batch)
    chunks = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    named, meta = ours_to_named(opt.state_dict(), chunks, "tp1")
    shards = reshard({(0, 0): chunks}, 1, 1, 2, 1, dims)
    named2 = reshard_named({(0, 0): named}, dims, 2, 1, GPT)
    opt_states = {r: named_to_ours(named2[r], meta, shards[r]) for r in shards}
    want_loss = _train_step(model, opt, batch)  # the uninterrupted TP=1 run's third step
    out = str(tmp_path / "tp2.pt")
    run_distributed(_continue_tp_body, world_size=2, args=(asdict(dims), shards, opt_states, batch, out))
    got = torch.load(out, weights_only=True)
    torch.testing.assert_close(got["loss"], want_loss, atol=1e-5, rtol=1e-5)
    merged = merge_tp_pp(got["shards"])
    for name, t in model.state_dict().items():
        torch.testing.assert_close(merged[name], t, atol=2e-5, rtol=1e-4)


def test_virtual_pipeline_chunks_follow_megatrons_assignment():
    dims = tiny_dims(layers=4)
    full = random_full(dims)
    ranks = split_tp_pp(full, dims, 1, 2, vpp=2)  # chunk v of rank r holds global layer v * 2 + r
    assert [len(ranks[(0, p)]) for p in range(2)] == [2, 2]
    w = "self_attention.linear_qkv.weight"
    assert torch.equal(ranks[(0, 1)][0][f"decoder.layers.0.{w}"], full[f"decoder.layers.1.{w}"])
    assert torch.equal(ranks[(0, 0)][1][f"decoder.layers.0.{w}"], full[f"decoder.layers.2.{w}"])
    assert "embedding.word_embeddings.weight" in ranks[(0, 0)][0] and "output_layer.weight" in ranks[(0, 1)][1]
    merged = merge_tp_pp(ranks)
    assert list(merged) == list(full) and all(torch.equal(merged[k], full[k]) for k in full)


def test_fp32_optimizer_through_megatron_layout_and_back(tmp_path):
    """An fp32 run's optimizer written in Megatron-LM's fp32 layout (the torch state dict itself, Megatron's
    parameter order) reads back identical, and converts to the mixed-precision layout from the model weights."""
    from megatron.core.checkpoint_formats import (load_megatron_file, read_megatron_checkpoint,
                                                  write_megatron_checkpoint)

    dims = tiny_dims(vocab=100, divisible_by=8)
    batch = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(6))
    model = build_stage(dims, ParallelState.single(), random_full(dims))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model], ParallelState.single())
    _train_step(model, opt, batch)
    chunks = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    named, meta = ours_to_named(opt.state_dict(), chunks, "fp32 run")
    out = str(tmp_path / "mg")
    args = {"global_batch_size": 2, "num_layers": 2}
    write_megatron_checkpoint(out, {(0, 0): chunks}, dims, args, iteration=1,
                              optimizer_by_name={(0, 0): (named, meta)})
    raw = load_megatron_file(os.path.join(out, "iter_0000001", "mp_rank_00", "model_optim_rng.pt"))
    assert set(raw["optimizer"]) == {"state", "param_groups"}  # fp32: the torch optimizer's own state dict
    qkv = [k for k in raw["model"] if "layers.0.self_attention" in k and not k.endswith("_extra_state")]
    assert qkv[0].endswith("linear_proj.weight")  # Megatron-Core's order
    back = read_megatron_checkpoint(out)
    named2, meta2 = back.extra["optimizer_by_name"][(0, 0)]
    assert meta2["kind"] == "fp32" and meta2["step"] == meta["step"] == 1.0
    for name, entry in named[0].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(named2[0][name][key], entry[key]), name
    mixed = named_to_ours(named2, meta2, back.model_state_per_rank[(0, 0)], kind="mixed")
    bf16 = build_stage(dims, ParallelState.single(), {k: v.bfloat16() for k, v in chunks[0].items()},
                       dtype=torch.bfloat16)
    mp_opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [bf16], ParallelState.single())
    mp_opt.load_state_dict(mixed)
    for p, main in zip(mp_opt.model_params, mp_opt.main_params):
        name = next(n for n, q in bf16.named_parameters() if q is p)
        assert torch.equal(main.detach(), chunks[0][name])  # the fp32 weights become the main params
