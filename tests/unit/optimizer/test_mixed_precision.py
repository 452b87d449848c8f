"""fp16 loss scaling (overflow skips the step, scale halves, weights untouched), bf16 training on CPU,
non-finite grad norms, weight-decay groups and the fp32 main params."""

import copy
import math

import torch

from megatron.core.distributed import DDPConfig, DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from tests.unit.distributed.dp_tiny import global_batch, loss_fn, make_model

SINGLE = ParallelState.single()


def _wrap(dtype, ddp_config=None, **opt_kw):
    ddp = DistributedDataParallel(make_model(dtype=dtype), pstate=SINGLE, config=ddp_config or DDPConfig())
    opt = get_megatron_optimizer(OptimizerConfig(**opt_kw), [ddp], SINGLE)
    return ddp, opt


def _snapshot(ddp, opt):
    return [p.detach().clone() for p in ddp.parameters()], [m.detach().clone() for m in opt.main_params]


def test_fp16_overflow_skips_step_and_halves_scale_after_hysteresis():
    ddp, opt = _wrap(torch.float16, fp16=True, optimizer="sgd", sgd_momentum=0.0, lr=1.0, weight_decay=0.0,
                     clip_grad=0.0, initial_loss_scale=2.0 ** 8, hysteresis=2, loss_scale_window=1000)
    assert opt.get_loss_scale().item() == 256.0
    assert all(m.dtype == torch.float32 for m in opt.main_params)
    # a clean step: grads are unscaled before the update (SGD lr 1: main -= grad / scale)
    params0, mains0 = _snapshot(ddp, opt)
    g = [torch.randn(p.shape) for p in opt.model_params]  # main_params[i] is the fp32 copy of model_params[i]
    opt.zero_grad()
    for p, gi in zip(opt.model_params, g):
        p.main_grad.copy_(gi * 256.0)
    ok, norm, zeros = opt.step()
    assert ok and zeros is None
    assert abs(norm - math.sqrt(sum(float(x.pow(2).sum()) for x in g))) < 1e-4 * norm
    for m, m0, gi in zip(opt.main_params, mains0, g):
        torch.testing.assert_close(m, m0 - gi, rtol=0, atol=1e-6)
    for p, m in zip(opt.model_params, opt.main_params):
        assert torch.equal(p, m.half())

    # two overflowing steps: both skipped, weights untouched, the scale halves on the second (hysteresis 2)
    for expected_scale in (256.0, 128.0):
        params1, mains1 = _snapshot(ddp, opt)
        opt.zero_grad()
        for p in ddp.parameters():
            p.main_grad.normal_()
        next(ddp.parameters()).main_grad.view(-1)[3] = float("inf")
        ok, norm, _ = opt.step()
        assert not ok and norm is None
        assert opt.get_loss_scale().item() == expected_scale
        assert all(torch.equal(a, b) for a, b in zip(params1, ddp.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(mains1, opt.main_params))
    assert opt.state_dict()["grad_scaler"]["scale"] == 128.0


def test_fp16_real_backward_trains_and_static_scale():
    ddp, opt = _wrap(torch.float16, fp16=True, lr=1e-2, clip_grad=1.0, loss_scale=1024.0)
    x, y = global_batch(0)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = loss_fn(ddp(x.half()), y)
        opt.scale_loss(loss).backward()
        ok, norm, _ = opt.step()
        assert ok and math.isfinite(norm)
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert opt.get_loss_scale().item() == 1024.0
    # static scale: overflow still skips the step and leaves the scale alone
    opt.zero_grad()
    next(ddp.parameters()).main_grad.fill_(float("nan"))
    assert opt.step()[0] is False and opt.get_loss_scale().item() == 1024.0


def test_bf16_trains_on_cpu_with_fp32_main_params():
    ddp, opt = _wrap(torch.bfloat16, bf16=True, lr=1e-2, clip_grad=1.0)
    assert opt.get_loss_scale().item() == 1.0
    assert all(p.main_grad.dtype == torch.float32 for p in ddp.parameters())
    x, y = global_batch(0)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = loss_fn(ddp(x.bfloat16()), y)
        opt.scale_loss(loss).backward()
        assert opt.step()[0]
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    for p, m in zip(opt.model_params, opt.main_params):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32 and torch.equal(p, m.bfloat16())
    # loading model weights (a model-only checkpoint) refreshes the fp32 main params
    fresh = make_model(seed=7, dtype=torch.bfloat16)
    ddp.load_state_dict(fresh.state_dict())
    for p, m in zip(opt.model_params, opt.main_params):
        assert torch.equal(p.float(), m)
    # a NaN grad in bf16: the norm is NaN and the update is skipped (the trainer counts a nan iteration)
    before = _snapshot(ddp, opt)
    opt.zero_grad()
    next(ddp.parameters()).main_grad.view(-1)[0] = float("nan")
    ok, norm, _ = opt.step()
    assert not ok and math.isnan(norm)
    assert all(torch.equal(a, b) for a, b in zip(before[0], ddp.parameters()))


def test_fp32_optimizer_state_dict_roundtrip_and_nan():
    ddp, opt = _wrap(torch.float32, lr=1e-2)
    x, y = global_batch(0)
    for _ in range(2):
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    ddp2, opt2 = _wrap(torch.float32, lr=1e-2)
    ddp2.load_state_dict(ddp.state_dict())
    opt2.load_state_dict(sd)
    for d, o in ((ddp, opt), (ddp2, opt2)):
        o.zero_grad()
        loss_fn(d(x), y).backward()
        o.step()
    for p, q in zip(ddp.parameters(), ddp2.parameters()):
        assert torch.equal(p, q)
    opt.zero_grad()
    next(ddp.parameters()).main_grad.fill_(float("inf"))
    before = [p.detach().clone() for p in ddp.parameters()]
    ok, norm, _ = opt.step()
    assert not ok and math.isinf(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
    assert all(p.grad is None for p in ddp.parameters())  # no alias of the grad buffer left behind


def test_weight_decay_groups():
    ddp, opt = _wrap(torch.float32, lr=0.1, weight_decay=0.5, clip_grad=0.0)
    decay, no_decay = opt.param_groups
    assert (decay["wd_mult"], no_decay["wd_mult"], decay["lr_mult"]) == (1.0, 0.0, 1.0)
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 7  # 3 biases of Linear + 2 x (weight, bias) of LayerNorm
    # with zero grads AdamW only decays: matrices shrink by (1 - lr * wd), biases and norms stay put
    before = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    opt.zero_grad()
    assert opt.step()[0]
    for n, p in ddp.named_parameters():
        expected = before[n] * (1 - 0.1 * 0.5) if p.dim() == 2 else before[n]
        torch.testing.assert_close(p, expected, rtol=0, atol=1e-7)


def test_bf16_grads_reduced_in_bf16_when_asked():
    """grad_reduce_in_fp32=False keeps a bf16 buffer; the optimizer still steps fp32 main params."""
    ddp, opt = _wrap(torch.bfloat16, DDPConfig(grad_reduce_in_fp32=False), bf16=True, lr=1e-2)
    assert all(p.main_grad.dtype == torch.bfloat16 for p in ddp.parameters())
    x, y = global_batch(0)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = loss_fn(ddp(x.bfloat16()), y)
        loss.backward()
        assert opt.step()[0]
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
