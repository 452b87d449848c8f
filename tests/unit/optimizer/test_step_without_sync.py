"""``step_without_sync()`` (the update a CUDA graph captures) does what ``step()`` does, without reading anything
back to the host: same grad norm, same clipping, same AdamW update, and a skipped update on a non-finite norm.

The reference is ``step()`` with torch's AdamW on an identical copy of the model; both optimizers are fused
AdamW here (CPU fused kernels), so the updates agree to float32 rounding.
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
    if not capturable:  # the same fused kernel as the capturable optimizer, driven by step()
        for group in opt.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6])
def test_matches_step(dtype, clip):
    ref_model, ref_opt = _model_and_optimizer(dtype, False, clip)
    model, opt = _model_and_optimizer(dtype, True, clip)
    x = torch.randn(32, 8).to(dtype)
    for _ in range(4):
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).float().pow(2).sum().backward()
        ok, ref_norm, _ = ref_opt.step()
        found_inf, norm = opt.step_without_sync()
        assert ok and found_inf.item() == 0.0
        assert norm.item() == pytest.approx(ref_norm, rel=1e-6)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


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
