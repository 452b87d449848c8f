"""The gradient-accumulation linear on the PyTorch path: its weight gradient goes into ``main_grad`` by the GEMM,
its bias gradient (``ops.bias_grad``) comes back through autograd and the wrapper's hook."""

import torch

from megatron.core.fusions import ops


def test_bias_grad_is_the_column_sum_in_the_gradient_dtype():
    dy = torch.randn(3, 7, 5, dtype=torch.bfloat16)
    out = ops.bias_grad(dy)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dy.float().sum((0, 1)), atol=0.05, rtol=0.01)
    assert ops.bias_grad(dy, torch.float32).dtype == torch.float32


def test_fused_weight_and_hooked_bias_grads_with_overlapped_buckets():
    """The weight gradient is added into main_grad by the GEMM, the bias gradient by the wrapper's hook; both
    parameters' hooks fire, so --overlap-grad-reduce launches their buckets inside backward, and the buffer holds
    the reference gradients, counted once."""
    from megatron.core.distributed import DDPConfig, DistributedDataParallel
    from megatron.core.fusions.linear import LinearWithGradAccumulation
    from megatron.core.parallel_state import ParallelState

    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5)
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
