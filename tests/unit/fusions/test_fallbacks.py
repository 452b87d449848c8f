"""CPU checks of the paths that do not need a GPU: the chunked cross-entropy and the 16-bit-state softmax.

These run anywhere (no CUDA needed); the GPU kernels are covered by tests/gpu/test_fused_kernels.py.
"""

import pytest
import torch

from megatron.core.fusions import fused_vocab_cross_entropy, ops
from megatron.core.fusions.cross_entropy import cross_entropy_reference


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("inplace", [True, False])
def test_chunked_cross_entropy_matches_reference(dtype, tol, inplace):
    torch.manual_seed(0)
    v = 97
    logits = (torch.randn(11, 3, v) * 3).to(dtype)
    target = torch.randint(0, v, (11, 3))
    target[2, 1] = -100
    dloss = torch.rand(11, 3)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    # a chunk of 4 rows forces several chunks
    la = fused_vocab_cross_entropy(a, target, chunk_bytes=4 * v * 4, inplace_backward=inplace)
    lb = cross_entropy_reference(b, target)
    assert rel_err(la, lb) < 1e-5 and la[2, 1] == 0
    la.backward(dloss)
    lb.backward(dloss)
    assert rel_err(a.grad, b.grad) < tol
    assert torch.all(a.grad[2, 1] == 0)


def test_cross_entropy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target shape"):
        fused_vocab_cross_entropy(torch.randn(4, 2, 10), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_scaled_masked_softmax(dtype, tol):
    torch.manual_seed(0)
    b, n, s = 2, 3, 16
    scores = torch.randn(b, n, s, s).to(dtype)
    causal = torch.ones(s, s, dtype=torch.bool).triu_(1)
    padding = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    padding[1, ..., -5:] = True
    mask = causal | padding
    mask[1, 0, 0, :] = True  # a fully masked row gives zeros, not NaN
    mask = mask.expand(b, 1, s, s)
    g = torch.randn(b, n, s, s).to(dtype)
    x1, x2 = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    y1 = ops.scaled_masked_softmax(x1, mask, 0.125)
    y2 = ops.scaled_masked_softmax_reference(x2, mask, 0.125)
    assert y1.dtype == dtype and torch.isfinite(y1).all()
    assert torch.all(y1[1, :, 0] == 0)
    assert rel_err(y1, y2) < 1e-6
    y1.backward(g)
    y2.backward(g)
    assert rel_err(x1.grad, x2.grad) < tol


def test_scaled_masked_softmax_keeps_16bit_state():
    """Autograd keeps only the bf16 probabilities (2 bytes per score), not an fp32 copy."""
    scores = torch.randn(2, 4, 32, 32, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ops.scaled_masked_softmax(scores, torch.ones(32, 32, dtype=torch.bool).triu_(1), 0.5)
    assert saved == [(torch.bfloat16, scores.numel())]


@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_linear_matches_and_saves_less(with_bias):
    """F.linear(gelu(x + b), W) with the GeLU output recomputed: same values and grads, one [.., 4h] tensor fewer."""
    from megatron.core.fusions import bias_gelu_linear

    torch.manual_seed(0)
    x = torch.randn(7, 3, 64, dtype=torch.float64, requires_grad=True)
    b = torch.randn(64, dtype=torch.float64, requires_grad=True) if with_bias else None
    w = torch.randn(16, 64, dtype=torch.float64, requires_grad=True)
    g = torch.randn(7, 3, 16, dtype=torch.float64)
    leaves = [t for t in (x, b, w) if t is not None]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = bias_gelu_linear(x, b, w)
    out.backward(g)
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ref = torch.nn.functional.linear(ops.bias_gelu_reference(x, b), w)
    ref.backward(g)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
    for a, r in zip(got, [t.grad for t in leaves]):
        assert torch.allclose(a, r, rtol=1e-10, atol=1e-12)
    assert torch.Size([7, 3, 64]) in saved and saved.count(torch.Size([7, 3, 64])) == 1  # x only, no gelu(x+b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_grad_cpu_is_pytorch_column_sum(dtype):
    """Off CUDA ``ops.bias_grad`` is exactly PyTorch's column sum of dy viewed as [-1, n]; ``out_dtype`` sets the
    result's dtype (a wider one is also the accumulation dtype)."""
    torch.manual_seed(0)
    dy = torch.randn(5, 3, 40).to(dtype)
    ref = dy.reshape(-1, 40).sum(0)
    got = ops.bias_grad(dy)
    assert got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(ops.bias_grad(dy, dtype), ref)
    wide = ops.bias_grad(dy, torch.float32)
    assert wide.dtype == torch.float32
    assert torch.allclose(wide, dy.float().reshape(-1, 40).sum(0), rtol=1e-6, atol=1e-6)
    if dtype == torch.float32:  # a narrower out_dtype: sum in the input dtype, then cast
        narrow = ops.bias_grad(dy, torch.bfloat16)
        assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, ref.to(torch.bfloat16))
    empty = ops.bias_grad(torch.zeros(0, 2, 8, dtype=dtype), torch.float32)
    assert empty.dtype == torch.float32 and torch.equal(empty, torch.zeros(8))
