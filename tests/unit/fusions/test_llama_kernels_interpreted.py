"""The RMSNorm, rotary-embedding and SwiGLU Triton kernels run by Triton's interpreter on the CPU, forward and
backward, against their PyTorch references (fp32, and bf16 inputs with fp32 arithmetic).

Opt-in: needs ``triton`` and ``TRITON_INTERPRET=1`` in the environment before Python starts, e.g.
``TRITON_INTERPRET=1 python -m pytest tests/unit/fusions/test_llama_kernels_interpreted.py``. On a GPU machine the
same kernels are tested on the device by tests/gpu/test_fused_kernels.py.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on the CPU", allow_module_level=True)
te = pytest.importorskip("megatron.core.fusions._triton_elementwise", reason="needs triton")
tln = pytest.importorskip("megatron.core.fusions._triton_layer_norm", reason="needs triton")
trope = pytest.importorskip("megatron.core.fusions._triton_rope", reason="needs triton")

from megatron.core.fusions import ops  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _cpu_launch(monkeypatch):
    monkeypatch.setattr(tln, "sm_count", lambda index: 4)
    monkeypatch.setattr(te, "sm_count", lambda index: 4)


def _compare(fused, reference, inputs, dy):
    """Outputs and input gradients of ``fused(*a)`` and ``reference(*b)`` on copies of ``inputs``."""
    a = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in inputs]
    b = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in inputs]
    ya, yb = fused(*a), reference(*b)
    ya.backward(dy)
    yb.backward(dy)
    return ya, yb, [(x.grad, y.grad) for x, y in zip(a, b) if x is not None and x.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_kernel(dtype, zero_centered):
    g = torch.Generator().manual_seed(1)
    m, n = 37, 96
    x = (torch.randn(m, n, generator=g) * 2).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    ya, yb, grads = _compare(lambda x, w: tln.LayerNormFunction.apply(x, w, None, 1e-5, zero_centered, False, True),
                             lambda x, w: ops.rms_norm_reference(x, w, 1e-5, zero_centered), [x, w], dy)
    assert ya.dtype == dtype
    torch.testing.assert_close(ya, yb, **TOL[dtype])
    for ga, gb in grads:
        torch.testing.assert_close(ga.float(), gb.float(), atol=TOL[dtype]["atol"] * 10, rtol=TOL[dtype]["rtol"])

    # the residual form: the gradient arriving at the residual output is added to dx inside the kernel
    xa = x.float().clone().requires_grad_()
    xb = x.float().clone().requires_grad_()
    wf = w.float()
    dres = torch.randn(m, n, generator=g)
    ya, ra = tln.LayerNormFunction.apply(xa, wf, None, 1e-5, zero_centered, True, True)
    ((ya * dy.float()).sum() + (ra * dres).sum()).backward()
    yb = ops.rms_norm_reference(xb, wf, 1e-5, zero_centered)
    ((yb * dy.float()).sum() + (xb * dres).sum()).backward()
    torch.testing.assert_close(xa.grad, xb.grad, **TOL[torch.float32])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype,d,rot", [(torch.float32, 16, 16), (torch.float32, 24, 12), (torch.bfloat16, 16, 8)])
def test_rope_kernel(interleaved, dtype, d, rot):
    g = torch.Generator().manual_seed(2)
    s, b, n = 9, 2, 3
    t = torch.randn(s, b, n, d, generator=g).to(dtype)
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    f = torch.outer(torch.arange(s).float() * 37, inv)  # large angles too
    f = torch.stack((f, f), -1).flatten(-2) if interleaved else torch.cat((f, f), -1)
    freqs = f[:, None, None, :]
    dy = torch.randn(s, b, n, d, generator=g).to(dtype)
    ya, yb, grads = _compare(lambda t: trope.RotaryFunction.apply(t, freqs, interleaved),
                             lambda t: ops.apply_rotary_pos_emb_reference(t, freqs, interleaved), [t], dy)
    assert ya.dtype == dtype
    torch.testing.assert_close(ya, yb, **TOL[dtype])
    torch.testing.assert_close(ya[..., rot:], t[..., rot:], atol=0, rtol=0)
    for ga, gb in grads:
        torch.testing.assert_close(ga, gb, **TOL[dtype])
    # a strided view (the key slice of a fused [s, b, n, 3d] QKV) is read in place
    qkv = torch.randn(s, b, n, 3 * d, generator=g).to(dtype)
    k = qkv[..., d:2 * d]
    got = trope.RotaryFunction.apply(k, freqs, interleaved)
    assert got.is_contiguous()
    torch.testing.assert_close(got, ops.apply_rotary_pos_emb_reference(k, freqs, interleaved), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_kernel(dtype, with_bias):
    g = torch.Generator().manual_seed(3)
    m, f = 45, 72
    x = (torch.randn(3, m // 3, 2 * f, generator=g) * 3).to(dtype)
    bias = torch.randn(2 * f, generator=g).to(dtype) if with_bias else None
    dy = torch.randn(3, m // 3, f, generator=g).to(dtype)
    ya, yb, grads = _compare(te.BiasSwiGLUFunction.apply, ops.bias_swiglu_reference, [x, bias], dy)
    assert ya.dtype == dtype and ya.shape == (3, m // 3, f)
    torch.testing.assert_close(ya.float(), yb.float(), **TOL[dtype])
    assert len(grads) == (2 if with_bias else 1)
    for ga, gb in grads:  # bf16 reference rounds its intermediate products: compare relative to the norm
        err = ((ga.double() - gb.double()).norm() / gb.double().norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2)
