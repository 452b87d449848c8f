"""The gradient record (megatron/core/grad_record.py): ``zero_grad_buffer`` clears the main grads and marks them
zero, the first gradient of an iteration is written instead of added, later ones are added; a parameter no
backward reached keeps a zero gradient."""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.distributed import DDPConfig, DistributedDataParallel
from megatron.core.grad_record import GradRecord, add_grad, attach_main_grad, record_of
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig


class _TwoLinears(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        ps = ParallelState.single()
        self.fc1 = tensor_parallel.ColumnParallelLinear(16, 32, config=cfg, pstate=ps, bias=True)
        self.fc2 = tensor_parallel.RowParallelLinear(32, 16, config=cfg, pstate=ps, bias=True)
        self.unused = tensor_parallel.ColumnParallelLinear(16, 16, config=cfg, pstate=ps, bias=True)

    def forward(self, x):
        h, _ = self.fc1(x)
        out, _ = self.fc2(torch.nn.functional.gelu(h))
        return out


def _model(fp8):
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, ffn_hidden_size=32,
                            fp8=fp8, params_dtype=torch.bfloat16 if fp8 else torch.float32)
    torch.manual_seed(3)
    model = _TwoLinears(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    return model


@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_main_grads_hold_one_iteration(fp8):
    """Two iterations of two microbatches against plain autograd: after each, every main grad is that iteration's
    gradient (the previous iteration's cleared), and the unused layer's is zero."""
    ref_model, model = _model(fp8), _model(fp8)
    ddp = DistributedDataParallel(model, pstate=ParallelState.single(), config=DDPConfig())
    records = {name: record_of(p) for name, p in model.named_parameters()}
    assert all(r.main_grad is p.main_grad for r, p in zip(records.values(), model.parameters()))
    dtype = torch.bfloat16 if fp8 else torch.float32
    xs = [torch.randn(2, 16, 16).to(dtype) for _ in range(4)]
    for step in range(2):  # two iterations of two microbatches
        ddp.buffers[0].grad_data.fill_(float("nan"))  # whatever the buffer held before
        ddp.zero_grad_buffer()
        assert not ddp.buffers[0].grad_data.any() and all(r.is_zero for r in records.values())
        ref_model.zero_grad()
        for x in xs[2 * step:2 * step + 2]:
            model(x).float().pow(2).mean().backward()
            ref_model(x).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        for name, p in model.named_parameters():
            ref = dict(ref_model.named_parameters())[name].grad
            if name.startswith("unused"):
                assert ref is None and not p.main_grad.any() and records[name].is_zero, name
            else:
                assert not records[name].is_zero, name
                torch.testing.assert_close(p.main_grad, ref.float(), rtol=1e-5 if fp8 is None else 2e-2,
                                           atol=1e-6 if fp8 is None else 1e-3, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_gemm_writes_the_first_gradient(dtype):
    """Gradient-accumulation fusion's GEMM (``accumulate_wgrad``): while the slice is marked zero it writes (a
    NaN left in the buffer is not read) and clears the mark; then it adds."""
    from megatron.core.fusions.linear import accumulate_wgrad

    g = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.zeros(8, 16, dtype=dtype))
    record = attach_main_grad(w, torch.full((8, 16), float("nan")))
    assert record.is_zero and w.main_grad is record.main_grad
    dy, x = torch.randn(32, 8, generator=g).to(dtype), torch.randn(32, 16, generator=g).to(dtype)
    ref = dy.float().t() @ x.float()
    accumulate_wgrad(w, dy, x)
    assert not record.is_zero
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.main_grad, ref, **tol)
    accumulate_wgrad(w, dy, x)
    torch.testing.assert_close(w.main_grad, 2 * ref, **tol)


def test_hook_gradient_follows_the_zero_rule():
    """``add_grad`` (the wrapper's hook) writes while marked zero, then adds; the record is attached once."""
    p = torch.nn.Parameter(torch.zeros(3))
    record = attach_main_grad(p, torch.full((3,), float("nan")))
    add_grad(p, torch.tensor([1.0, 2.0, 3.0]))
    add_grad(p, torch.tensor([1.0, 1.0, 1.0]))
    torch.testing.assert_close(p.main_grad, torch.tensor([2.0, 3.0, 4.0]))
    assert isinstance(record, GradRecord) and record_of(p) is record and not record.is_zero
    with pytest.raises(ValueError, match="main_grad shape"):
        attach_main_grad(p, torch.zeros(4))
