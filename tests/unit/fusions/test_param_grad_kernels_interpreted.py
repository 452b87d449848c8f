"""The Triton kernels that finish bias and LayerNorm gradients, run by Triton's interpreter on the CPU: column sums
(one row group straight to the output, or partial rows finished by a second launch), the bias+GeLU backward, the
LayerNorm backward (gamma and beta finished in one launch) and the bias-dropout-add backward, each against
PyTorch's autograd.

Opt-in: needs ``triton`` and ``TRITON_INTERPRET=1`` in the environment before Python starts, e.g.
``TRITON_INTERPRET=1 python -m pytest tests/unit/fusions/test_param_grad_kernels_interpreted.py``. On a GPU
machine the same kernels are tested on the device by tests/gpu/test_fused_kernels.py.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on the CPU", allow_module_level=True)
te = pytest.importorskip("megatron.core.fusions._triton_elementwise", reason="needs triton")
tln = pytest.importorskip("megatron.core.fusions._triton_layer_norm", reason="needs triton")


@pytest.fixture(autouse=True)
def _cpu_launch(monkeypatch):
    monkeypatch.setattr(tln, "sm_count", lambda index: 4)


@pytest.mark.parametrize("m,n", [(4096, 96), (37, 70), (16, 64)])
def test_column_sum_and_bias_gelu_backward(m, n):
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, n, generator=g)
    torch.testing.assert_close(te.column_sum(x, torch.float32).double(), x.double().sum(0), atol=1e-4, rtol=1e-5)
    assert te._colsum_launch(m, n, x.device)[1] > 1 or m <= 64  # the large shape takes the two-launch path
    torch.testing.assert_close(te.column_sum(x[:0], torch.float32), torch.zeros(n))

    bias = torch.randn(n, generator=g)
    pre, dy = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    z = (pre + bias).requires_grad_()
    torch.nn.functional.gelu(z).backward(dy)
    dx, dbias = te.bias_gelu_backward(dy, pre, bias)
    torch.testing.assert_close(dx, z.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dbias.double(), z.grad.double().sum(0), atol=1e-3, rtol=1e-4)


def test_layer_norm_and_bias_dropout_add_backward():
    m, n = 64, 768
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    w, b = torch.randn(n, generator=g).requires_grad_(), torch.randn(n, generator=g).requires_grad_()
    wr, br = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.nn.functional.layer_norm(x, (n,), wr, br, 1e-5).backward(dy)
    tln.LayerNormFunction.apply(x.clone().requires_grad_(), w, b, 1e-5, False).backward(dy)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(b.grad, br.grad, atol=1e-3, rtol=1e-4)

    for prob in (0.0, 0.5):  # no dropout: dx is dout, dbias a column sum; dropout: the mask kernel's partials
        bias = torch.randn(n, generator=g).requires_grad_()
        xs, res = x.clone().requires_grad_(), x.clone().requires_grad_()
        te.BiasDropoutAddFunction.apply(xs, bias, res, prob, True).backward(dy)
        torch.testing.assert_close(res.grad, dy)
        torch.testing.assert_close(bias.grad, xs.grad.sum(0), atol=1e-3, rtol=1e-4)
        if prob:
            assert (xs.grad == 0).float().mean().item() == pytest.approx(prob, abs=0.02)
