"""Gradient-accumulation fusion for biases (fusions/main_grad.py) on the PyTorch path of ``bias_grad``."""

import pytest
import torch

from megatron.core.fusions import ops
from megatron.core.fusions.main_grad import main_grad_sink


def _bias(flag, main_grad_dtype=torch.float32):
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    p.grad_accumulation_fusion = flag
    p.main_grad = torch.full((5,), 1.0, dtype=main_grad_dtype)
    return p


@pytest.mark.parametrize("flag", [True, False])
def test_bias_grad_adds_into_main_grad_only_when_flagged(flag):
    dy = torch.randn(3, 7, 5, dtype=torch.bfloat16)
    p = _bias(flag)
    out = ops.bias_grad(dy, bias_param=p)
    want = dy.float().sum((0, 1))
    if flag:
        assert out is None and p.grad_added_to_main_grad and not p.main_grad_is_zero
        torch.testing.assert_close(p.main_grad, want + 1.0)  # fp32 sums, added to what was there
    else:
        torch.testing.assert_close(out.float(), want, atol=0.05, rtol=0.01)
        assert out.dtype == torch.bfloat16 and torch.equal(p.main_grad, torch.ones(5))


def test_sink_needs_an_fp32_main_grad_and_requires_grad():
    assert main_grad_sink(None) is None
    assert main_grad_sink(_bias(True, torch.bfloat16)) is None  # grads reduced in bf16: the hook adds them
    p = _bias(True)
    assert main_grad_sink(p) is p.main_grad
    p.requires_grad_(False)
    assert main_grad_sink(p) is None
    q = torch.nn.Parameter(torch.zeros(5))
    q.grad_accumulation_fusion = True
    assert main_grad_sink(q) is None  # not wrapped by the DDP wrapper: no main_grad


def test_fused_weight_and_bias_grads_with_overlapped_buckets():
    """The grad-accumulation linear (run here on CPU) adds both its weight and its flagged bias gradient into
    main_grad; the parameters' hooks still fire, so --overlap-grad-reduce launches their buckets inside backward,
    and the buffer holds the reference gradients, counted once."""
    from megatron.core.distributed import DDPConfig, DistributedDataParallel
    from megatron.core.fusions.linear import LinearWithGradAccumulation
    from megatron.core.parallel_state import ParallelState

    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5)
    lin.bias.grad_accumulation_fusion = True
    ref_w, ref_b = (p.detach().clone().requires_grad_() for p in (lin.weight, lin.bias))
    ddp = DistributedDataParallel(torch.nn.ModuleList([lin]), pstate=ParallelState.single(),
                                  config=DDPConfig(overlap_grad_reduce=True, bucket_size=1))
    assert len(ddp.buckets()) == 2  # weight and bias in buckets of their own
    x = torch.randn(4, 3, 6)
    LinearWithGradAccumulation.apply(x, lin.weight, lin.bias).pow(2).sum().backward()
    assert all(b.grad_handle is not None for b in ddp.buckets())  # launched inside backward
    ddp.finish_grad_sync()
    torch.nn.functional.linear(x, ref_w, ref_b).pow(2).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None and lin.bias.grad_added_to_main_grad
    torch.testing.assert_close(lin.weight.main_grad, ref_w.grad)
    torch.testing.assert_close(lin.bias.main_grad, ref_b.grad)
