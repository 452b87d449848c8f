"""The Triton kernels that finish small-parameter gradients, run by Triton's interpreter on the CPU: column sums
(finished by the last program to arrive, or by a second launch), the bias+GeLU backward, the LayerNorm backward
and the bias-dropout-add backward, each storing into a gradient sink under the zero rule
(``megatron/core/grad_record.py``): written over a NaN-filled ``main_grad`` while it is marked zero, added after.

Opt-in: needs ``triton`` and ``TRITON_INTERPRET=1`` in the environment before Python starts, e.g.
``TRITON_INTERPRET=1 python -m pytest tests/unit/fusions/test_grad_sinks_interpreted.py``. On a GPU machine the
same kernels are tested on the device by tests/gpu/test_fused_kernels.py.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on the CPU", allow_module_level=True)
te = pytest.importorskip("megatron.core.fusions._triton_elementwise", reason="needs triton")
tln = pytest.importorskip("megatron.core.fusions._triton_layer_norm", reason="needs triton")

from megatron.core.grad_record import attach_main_grad, declare_grad_sink  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_launch(monkeypatch):
    counters = te._block_counters
    monkeypatch.setattr(te, "_block_counters", lambda device, blocks: counters(torch.device("cpu", 0), blocks))
    monkeypatch.setattr(tln, "sm_count", lambda index: 4)


def _sink(n):
    p = torch.nn.Parameter(torch.randn(n))
    declare_grad_sink(p, True)
    return p, attach_main_grad(p, torch.full((n,), float("nan")))


@pytest.mark.parametrize("finish_in_last_program", [True, False])
@pytest.mark.parametrize("m,n", [(4096, 96), (37, 70), (16, 64)])
def test_column_sum_and_bias_gelu_backward_store_into_a_sink(monkeypatch, finish_in_last_program, m, n):
    monkeypatch.setattr(te, "FINISH_IN_LAST_PROGRAM", finish_in_last_program)
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, n, generator=g)
    ref = x.double().sum(0)
    torch.testing.assert_close(te.column_sum(x, torch.float32).double(), ref, atol=1e-4, rtol=1e-5)
    out = torch.full((n,), float("nan"))
    te.column_sum(x, torch.float32, out, False)  # written: the NaN is never read
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)
    te.column_sum(x, torch.float32, out, True)
    torch.testing.assert_close(out.double(), 2 * ref, atol=2e-4, rtol=1e-5)

    bias, record = _sink(n)
    pre, dy = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    z = (pre + bias.detach()).requires_grad_()
    torch.nn.functional.gelu(z).backward(dy)
    dx, dbias = te.bias_gelu_backward(dy, pre, bias.detach(), bias)
    assert dbias is None and not record.is_zero
    torch.testing.assert_close(dx, z.grad, atol=1e-5, rtol=1e-4)
    want = z.grad.double().sum(0)
    torch.testing.assert_close(bias.main_grad.double(), want, atol=1e-3, rtol=1e-4)
    te.bias_gelu_backward(dy, pre, bias.detach(), bias)
    torch.testing.assert_close(bias.main_grad.double(), 2 * want, atol=2e-3, rtol=1e-4)


def test_layer_norm_and_bias_dropout_add_backward_store_into_sinks():
    m, n = 64, 768
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    (w, w_record), (b, b_record) = _sink(n), _sink(n)
    wr, br = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.nn.functional.layer_norm(x, (n,), wr, br, 1e-5).backward(dy)
    for step in (1, 2):  # the first backward writes, the second adds
        xs = x.clone().requires_grad_()
        tln.LayerNormFunction.apply(xs, w, b, 1e-5, False).backward(dy)
        assert w.grad is None and b.grad is None and not w_record.is_zero and not b_record.is_zero
        torch.testing.assert_close(w.main_grad, step * wr.grad, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(b.main_grad, step * br.grad, atol=1e-3, rtol=1e-4)

    bias, record = _sink(n)
    out = te.BiasDropoutAddFunction.apply(x.clone().requires_grad_(), bias, x.clone().requires_grad_(), 0.0, True)
    out.backward(dy)
    assert bias.grad is None and not record.is_zero
    torch.testing.assert_close(bias.main_grad, dy.sum(0), atol=1e-3, rtol=1e-4)
