"""Small-parameter gradient sinks (megatron/core/grad_record.py) on the PyTorch path of ``bias_grad``."""

import pytest
import torch

from megatron.core import grad_record
from megatron.core.fusions import ops
from megatron.core.grad_record import attach_main_grad, declare_grad_sink, grad_sink


def _bias(flag, main_grad_dtype=torch.float32):
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    declare_grad_sink(p, flag)
    attach_main_grad(p, torch.full((5,), 1.0, dtype=main_grad_dtype)).is_zero = False
    return p


@pytest.mark.parametrize("flag", [True, False])
def test_bias_grad_adds_into_main_grad_only_when_declared(flag):
    dy = torch.randn(3, 7, 5, dtype=torch.bfloat16)
    p = _bias(flag)
    out = ops.bias_grad(dy, bias_param=p)
    want = dy.float().sum((0, 1))
    if flag:
        assert out is None
        torch.testing.assert_close(p.main_grad, want + 1.0)  # fp32 sums, added to what was there
        p.grad_record.is_zero = True  # a new iteration: the sums overwrite the slice
        assert ops.bias_grad(dy, bias_param=p) is None
        torch.testing.assert_close(p.main_grad, want)
        assert not p.grad_record.is_zero
    else:
        torch.testing.assert_close(out.float(), want, atol=0.05, rtol=0.01)
        assert out.dtype == torch.bfloat16 and torch.equal(p.main_grad, torch.ones(5))


def test_sink_switch_returns_the_gradient(monkeypatch):
    monkeypatch.setattr(grad_record, "SMALL_PARAM_GRAD_SINK", False)
    dy = torch.randn(4, 5, dtype=torch.bfloat16)
    p = _bias(True)
    out = ops.bias_grad(dy, bias_param=p)
    assert out is not None and torch.equal(p.main_grad, torch.ones(5))


def test_sink_needs_an_fp32_main_grad_and_requires_grad():
    assert grad_sink(None) is None
    assert grad_sink(_bias(True, torch.bfloat16)) is None  # grads reduced in bf16: the hook adds them
    p = _bias(True)
    assert grad_sink(p) is p.grad_record
    p.requires_grad_(False)
    assert grad_sink(p) is None
    q = torch.nn.Parameter(torch.zeros(5))
    declare_grad_sink(q, True)
    assert grad_sink(q) is None  # not wrapped by the DDP wrapper: no main_grad


def test_fused_weight_and_bias_grads_with_overlapped_buckets():
    """The grad-accumulation linear (run here on CPU) adds both its weight and its flagged bias gradient into
    main_grad; the parameters' hooks still fire, so --overlap-grad-reduce launches their buckets inside backward,
    and the buffer holds the reference gradients, counted once."""
    from megatron.core.distributed import DDPConfig, DistributedDataParallel
    from megatron.core.fusions.linear import LinearWithGradAccumulation
    from megatron.core.parallel_state import ParallelState

    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5)
    declare_grad_sink(lin.bias, True)
    ref_w, ref_b = (p.detach().clone().requires_grad_() for p in (lin.weight, lin.bias))
    ddp = DistributedDataParallel(torch.nn.ModuleList([lin]), pstate=ParallelState.single(),
                                  config=DDPConfig(overlap_grad_reduce=True, bucket_size=1))
    assert len(ddp.buckets()) == 2  # weight and bias in buckets of their own
    x = torch.randn(4, 3, 6)
    LinearWithGradAccumulation.apply(x, lin.weight, lin.bias).pow(2).sum().backward()
    assert all(b.grad_handle is not None for b in ddp.buckets())  # launched inside backward
    ddp.finish_grad_sync()
    torch.nn.functional.linear(x, ref_w, ref_b).pow(2).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None
    torch.testing.assert_close(lin.weight.main_grad, ref_w.grad)
    torch.testing.assert_close(lin.bias.main_grad, ref_b.grad)
