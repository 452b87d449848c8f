"""The distributed optimizer's state dict is DP-size independent: saved at DP=2, loaded at DP=4, training
continues exactly like an uninterrupted single-process run. Also bf16 under the distributed optimizer."""

import os
import tempfile

import torch

from megatron.core.distributed import DDPConfig, DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed
from tests.unit.distributed.dp_tiny import dp_train, global_batch, loss_fn, make_model, reference_run

FIRST, SECOND = 3, 3


def _build(pstate, seed, dtype=torch.float32, bucket_size=150, **opt_kw):
    ddp = DistributedDataParallel(make_model(seed, dtype), pstate=pstate,
                                  config=DDPConfig(use_distributed_optimizer=True, bucket_size=bucket_size))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5,
                                                 use_distributed_optimizer=True, **opt_kw), [ddp], pstate)
    return ddp, opt


def _save(rank, world, path):
    pstate = ParallelState.build(1, 1)
    ddp, opt = _build(pstate, 1234)
    dp_train(ddp, opt, pstate, FIRST, microbatches=2)
    optim_state = opt.state_dict()  # collective over DP
    model_state = ddp.state_dict()
    if rank == 0:
        torch.save({"model": model_state, "optimizer": optim_state}, path)
        assert len(optim_state["params"]) == len(list(ddp.parameters()))
        assert optim_state["scalar_state"] == {"step": float(FIRST)}
    _bf16(rank, world)  # reuse these processes for the bf16 and fp16 checks
    _fp16_overflow_on_one_rank(rank, world)


def _resume(rank, world, path):
    pstate = ParallelState.build(1, 1)
    ddp, opt = _build(pstate, 999, bucket_size=None)  # different init and bucket layout: all comes from the file
    ckpt = torch.load(path, weights_only=True)
    ddp.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    norms = dp_train(ddp, opt, pstate, SECOND, microbatches=1, start_step=FIRST)
    ref_model, ref_opt, ref_norms = reference_run(FIRST + SECOND)
    for n, r in zip(norms, ref_norms[FIRST:]):
        assert abs(n - r) <= 1e-6 * r, (norms, ref_norms)
    for (name, p), q in zip(ddp.named_parameters(), ref_model.parameters()):
        assert (p - q).abs().max().item() < 2e-6, name
    # and the state saved at DP=4 equals the one an uninterrupted single process would hold
    state = opt.state_dict()
    ref_params = list(ref_model.parameters())
    for entry, q in zip(state["params"], ref_params):
        torch.testing.assert_close(entry["param"], q.detach(), rtol=0, atol=2e-6)
        torch.testing.assert_close(entry["exp_avg"], ref_opt.state[q]["exp_avg"], rtol=1e-4, atol=1e-7)


def test_save_at_dp2_resume_at_dp4_and_bf16():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "optim.pt")
        run_distributed(_save, 2, (path,))
        run_distributed(_resume, 4, (path,))


def _bf16(rank, world):
    """bf16 params, fp32 sharded main params: training reduces the loss and every replica stays identical."""
    pstate = ParallelState.build(1, 1)
    ddp, opt = _build(pstate, 1234, dtype=torch.bfloat16, bf16=True)
    assert opt.owned_main_params() and all(m.dtype == torch.float32 for m in opt.owned_main_params())
    x, y = global_batch(0)
    x, y = x[rank * 4:(rank + 1) * 4].bfloat16(), y[rank * 4:(rank + 1) * 4]
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        from megatron.core.distributed import finalize_model_grads
        finalize_model_grads([ddp], pstate)
        assert opt.step()[0]
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    flat = torch.cat([p.detach().float().reshape(-1) for p in ddp.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    # the full state dict's fp32 params round to the model's bf16 params
    for entry, p in zip(opt.state_dict()["params"], ddp.parameters()):
        assert torch.equal(entry["param"].bfloat16(), p.detach())


def _fp16_overflow_on_one_rank(rank, world):
    """fp16 + distributed optimizer: an inf in the shard of DP rank 0 alone makes every rank skip the step."""
    from megatron.core.distributed import finalize_model_grads

    pstate = ParallelState.build(1, 1)
    ddp, opt = _build(pstate, 1234, dtype=torch.float16, fp16=True, hysteresis=1, initial_loss_scale=2.0 ** 12)
    x, y = global_batch(0)
    x, y = x[rank * 4:(rank + 1) * 4].half(), y[rank * 4:(rank + 1) * 4]
    opt.zero_grad()
    opt.scale_loss(loss_fn(ddp(x), y)).backward()
    finalize_model_grads([ddp], pstate)
    before = [p.detach().clone() for p in ddp.parameters()]
    mains = [m.detach().clone() for m in opt.owned_main_params()]
    if rank == 0:
        buf = ddp.buffers[0]
        lo, _ = buf.shard_range(buf.buckets[0], 0)
        buf.grad_data[lo] = float("inf")  # only rank 0 reads this element
    ok, norm, _ = opt.step()
    assert not ok and norm is None
    assert opt.get_loss_scale().item() == 2.0 ** 11  # hysteresis 1: halves at once, on every rank
    assert all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(mains, opt.owned_main_params()))
    # the next clean step goes through
    opt.zero_grad()
    opt.scale_loss(loss_fn(ddp(x), y)).backward()
    finalize_model_grads([ddp], pstate)
    assert opt.step()[0]
