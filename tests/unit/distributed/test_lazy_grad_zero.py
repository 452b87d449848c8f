"""The linear layers' weights are not zeroed between iterations (``lazy_grad_zero``, grad_buffer.py): their
main grads keep stale values, the first gradient of an iteration is written instead of added, and one that no
backward wrote is zeroed before the reduction. Poisoning those ranges with NaN must change nothing."""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.distributed import DDPConfig, DistributedDataParallel
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
def test_stale_weight_grads_change_nothing(fp8):
    ref_model, model = _model(fp8), _model(fp8)
    ddp = DistributedDataParallel(model, pstate=ParallelState.single(), config=DDPConfig())
    lazy = ddp.buffers[0].lazy_params
    assert {id(p) for p in lazy} == {id(m.weight) for m in (model.fc1, model.fc2, model.unused)}
    dtype = torch.bfloat16 if fp8 else torch.float32
    xs = [torch.randn(2, 16, 16).to(dtype) for _ in range(4)]
    for step in range(2):  # two iterations of two microbatches
        ddp.zero_grad_buffer()
        for p in lazy:
            p.main_grad.fill_(float("nan"))  # what an unzeroed range may hold
        model.fc1.bias.main_grad.fill_(float("nan"))
        ddp.zero_grad_buffer()  # zeroes the biases; the weights stay poisoned until written
        assert torch.isnan(model.fc1.weight.main_grad).all() and not model.fc1.bias.main_grad.any()
        ref_model.zero_grad()
        for x in xs[2 * step:2 * step + 2]:
            model(x).float().pow(2).mean().backward()
            ref_model(x).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        for name, p in model.named_parameters():
            ref = dict(ref_model.named_parameters())[name].grad
            if name.startswith("unused"):
                assert ref is None and not p.main_grad.any(), name  # settled to zero
            else:
                torch.testing.assert_close(p.main_grad, ref.float(), rtol=1e-5 if fp8 is None else 2e-2,
                                           atol=1e-6 if fp8 is None else 1e-3, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_gemm_writes_the_first_gradient(dtype):
    """Gradient-accumulation fusion's GEMM (``_accumulate_wgrad``): with ``main_grad_is_zero`` it writes (a NaN
    left in the buffer is not read) and clears the mark; then it adds."""
    from megatron.core.fusions.linear import _accumulate_wgrad

    g = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.zeros(8, 16, dtype=dtype))
    w.main_grad = torch.full((8, 16), float("nan"))
    w.main_grad_is_zero = True
    dy, x = torch.randn(32, 8, generator=g).to(dtype), torch.randn(32, 16, generator=g).to(dtype)
    ref = dy.float().t() @ x.float()
    _accumulate_wgrad(w, dy, x)
    assert not w.main_grad_is_zero and w.grad_added_to_main_grad
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.main_grad, ref, **tol)
    _accumulate_wgrad(w, dy, x)
    torch.testing.assert_close(w.main_grad, 2 * ref, **tol)
