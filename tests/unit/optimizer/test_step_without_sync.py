"""The fused-AdamW steps fold gradient clipping into the update (``grad_scale`` = 1 / clip coefficient) instead of
multiplying every gradient first: ``step()`` on a fused optimizer and ``step_without_sync()`` (the update a CUDA
graph captures, with nothing read back to the host) must both match the plain "multiply the grads, then step"
reference: same grad norm, same clipping, same update, and a skipped update on a non-finite norm.

The reference drives the same fused AdamW kernel (CPU fused kernels) through the multiply path, so the results
agree to float32 rounding (dividing by 1/c instead of multiplying by c).
"""

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState


def _model_and_optimizer(dtype, capturable, clip):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)
    cfg = OptimizerConfig(lr=1e-2, clip_grad=clip, weight_decay=0.1, bf16=dtype == torch.bfloat16,
                          capturable=capturable)
    opt = get_megatron_optimizer(cfg, [model], ParallelState.single())
    if not capturable:  # the same fused kernel, driven through the multiply-then-step path of step()
        for group in opt.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
    return model, opt


def _assert_close_models(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6])
def test_fused_steps_match_multiply_then_step(dtype, clip):
    ref_model, ref_opt = _model_and_optimizer(dtype, False, clip)
    eager_model, eager_opt = _model_and_optimizer(dtype, True, clip)  # step() on the fused optimizer
    model, opt = _model_and_optimizer(dtype, True, clip)  # step_without_sync()
    x = torch.randn(32, 8).to(dtype)
    clipped = 0
    for _ in range(4):
        for m, o in ((ref_model, ref_opt), (eager_model, eager_opt), (model, opt)):
            o.zero_grad()
            m(x).float().pow(2).sum().backward()
        ok, ref_norm, _ = ref_opt.step()
        ok_eager, eager_norm, _ = eager_opt.step()
        found_inf, norm = opt.step_without_sync()
        assert ok and ok_eager and found_inf.item() == 0.0
        assert eager_norm == pytest.approx(ref_norm, rel=1e-6)
        assert norm.item() == pytest.approx(ref_norm, rel=1e-6)
        clipped += int(0 < clip < ref_norm)
    if clip == 0.5:
        assert clipped == 4  # the clipping path was exercised
    _assert_close_models(ref_model, eager_model)
    _assert_close_models(ref_model, model)


def test_non_finite_norm_skips_the_update():
    model, opt = _model_and_optimizer(torch.float32, True, 1.0)
    x = torch.randn(32, 8)
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step_without_sync()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    (model(x).pow(2).sum() * float("nan")).backward()
    found_inf, norm = opt.step_without_sync()
    assert found_inf.item() == 1.0 and not torch.isfinite(norm).item()
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)
    steps = {opt.optimizer.state[p]["step"].item() for p in opt.optimizer.state}
    assert steps == {1.0}  # the skipped step is not counted


def test_needs_no_loss_scaler():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).half()
    opt = get_megatron_optimizer(OptimizerConfig(fp16=True), [model], ParallelState.single())
    with pytest.raises(ValueError, match="no fp16 loss scaling"):
        opt.step_without_sync()


@pytest.mark.parametrize("save_capturable", [False, True])
def test_checkpoint_keeps_this_runs_implementation(save_capturable):
    """An optimizer checkpoint moves between a plain (foreach) and a capturable fused run: hyperparameters and
    state come from the checkpoint, the implementation flags from the loading run, and both keep training."""
    src_model, src = _model_and_optimizer(torch.float32, save_capturable, 1.0)
    if not save_capturable:
        for group in src.optimizer.param_groups:
            group["fused"], group["foreach"] = None, True  # the CPU default
    x = torch.randn(32, 8)
    src.zero_grad()
    src_model(x).pow(2).sum().backward()
    src.step()
    state = src.state_dict()
    dst_model, dst = _model_and_optimizer(torch.float32, not save_capturable, 1.0)
    if save_capturable:
        for group in dst.optimizer.param_groups:
            group["fused"], group["foreach"] = None, True
        dst.optimizer.defaults.update(fused=None, foreach=True, capturable=False)
    dst.load_state_dict(state)
    for group in dst.optimizer.param_groups:
        assert group["capturable"] == (not save_capturable)
        assert bool(group["fused"]) == (not save_capturable)
        assert group["lr"] == 1e-2 and group["weight_decay"] in (0.1, 0.0)
    steps = {dst.optimizer.state[p]["step"].item() for p in dst.optimizer.state}
    assert steps == {1.0}
    dst_model.load_state_dict(src_model.state_dict())
    dst.zero_grad()
    dst_model(x).pow(2).sum().backward()
    if save_capturable:
        assert dst.step()[0]
    else:
        assert dst.step_without_sync()[0].item() == 0.0
    assert {dst.optimizer.state[p]["step"].item() for p in dst.optimizer.state} == {2.0}
