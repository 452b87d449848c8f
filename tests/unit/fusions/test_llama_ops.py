"""CPU checks of the RMSNorm, rotary-embedding and SwiGLU ops: the public functions (which fall back to their
references off CUDA) against independent formulas (Hugging Face's Llama modules, a complex-number rotation,
``x * sigmoid(x)``), and their gradients by ``gradcheck`` in float64. The Triton kernels are compared with the same
references on the GPU (tests/gpu/test_fused_kernels.py) and under Triton's interpreter
(tests/unit/fusions/test_llama_kernels_interpreted.py)."""

import pytest
import torch

from megatron.core.fusions import apply_rotary_pos_emb, bias_swiglu, ops, rms_norm, rms_norm_with_residual, swiglu


def _freqs(s, rot, base=10000.0, interleaved=False):
    """[s, 1, 1, rot] angles laid out as Megatron's rotary embedding lays them out."""
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)  # [s, rot/2]
    f = torch.stack((f, f), dim=-1).flatten(-2) if interleaved else torch.cat((f, f), dim=-1)
    return f[:, None, None, :]


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hugging_face(zero_centered, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    h = 48
    x = (torch.randn(5, 3, h) * 3).to(dtype)
    gamma = torch.randn(h)
    hf = LlamaRMSNorm(h, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(gamma)
    stored = gamma - 1 if zero_centered else gamma
    got = rms_norm(x, stored.to(dtype), 1e-5, zero_centered_gamma=zero_centered)
    assert got.dtype == dtype
    # Hugging Face multiplies by gamma after casting back to the input dtype: compare in fp32 for exactness
    want = hf(x.float())
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    y, res = rms_norm_with_residual(x, stored.to(dtype), 1e-5, zero_centered_gamma=zero_centered)
    assert torch.equal(y, got) and res is x


def test_rms_norm_gradients_float64():
    torch.manual_seed(1)
    x = torch.randn(4, 2, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6, zero_centered_gamma=True), (x, w))
    # the residual form: both outputs' gradients reach x
    assert torch.autograd.gradcheck(lambda a, b: rms_norm_with_residual(a, b, 1e-6), (x, w))


@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
def test_rope_matches_hugging_face_rotate_half(rot_frac):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

    torch.manual_seed(2)
    s, b, n, d = 7, 2, 3, 16
    rot = int(d * rot_frac)
    t = torch.randn(s, b, n, d)
    freqs = _freqs(s, rot)
    got = apply_rotary_pos_emb(t, freqs)
    # Hugging Face: q [b, n, s, d], cos/sin [b, s, rot] with the two halves of the frequencies concatenated
    q = t[..., :rot].permute(1, 2, 0, 3)
    cos = freqs[:, 0, 0].cos()[None].expand(b, s, rot)
    sin = freqs[:, 0, 0].sin()[None].expand(b, s, rot)
    want, _ = hf_rope(q, q, cos, sin)
    torch.testing.assert_close(got[..., :rot], want.permute(2, 0, 1, 3), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., rot:], t[..., rot:])
    assert torch.equal(got[0], t[0])  # position 0 is not rotated


def test_rope_interleaved_is_complex_rotation():
    """Adjacent pairs (x[2i], x[2i+1]) as the complex number x[2i] + i x[2i+1], multiplied by exp(i theta)."""
    torch.manual_seed(3)
    s, b, n, d, rot = 6, 2, 2, 12, 8
    t = torch.randn(s, b, n, d, dtype=torch.float64)
    freqs = _freqs(s, rot, interleaved=True)
    got = apply_rotary_pos_emb(t, freqs, interleaved=True)
    z = torch.view_as_complex(t[..., :rot].reshape(s, b, n, rot // 2, 2).contiguous())
    theta = freqs[..., 0::2].double()
    want = torch.view_as_real(z * torch.polar(torch.ones_like(theta), theta)).flatten(-2)
    torch.testing.assert_close(got[..., :rot], want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[..., rot:], t[..., rot:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_gradient_is_inverse_rotation(interleaved):
    torch.manual_seed(4)
    s, b, n, d, rot = 5, 2, 2, 10, 8
    t = torch.randn(s, b, n, d, dtype=torch.float64, requires_grad=True)
    freqs = _freqs(s, rot, interleaved=interleaved).double()
    assert torch.autograd.gradcheck(lambda a: apply_rotary_pos_emb(a, freqs, interleaved=interleaved), (t,))
    g = torch.randn(s, b, n, d, dtype=torch.float64)
    (dt,) = torch.autograd.grad(apply_rotary_pos_emb(t, freqs, interleaved=interleaved), t, g)
    torch.testing.assert_close(dt, apply_rotary_pos_emb(g, -freqs, interleaved=interleaved))
    with pytest.raises(ValueError, match="rotary dimension 7"):
        apply_rotary_pos_emb(t, freqs[..., :7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_formula(dtype):
    torch.manual_seed(5)
    x = (torch.randn(4, 3, 2 * 20) * 3).to(dtype)
    bias = torch.randn(40).to(dtype)
    gate, up = x.float()[..., :20], x.float()[..., 20:]
    want = gate * torch.sigmoid(gate) * up
    got = swiglu(x)
    assert got.shape == (4, 3, 20) and got.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=3e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    xb = x.float() + bias.float()
    want_b = xb[..., :20] * torch.sigmoid(xb[..., :20]) * xb[..., 20:]
    torch.testing.assert_close(bias_swiglu(x, bias).float(), want_b, **(tol if dtype == torch.float32 else
                                                                        dict(rtol=3e-2, atol=6e-2)))
    assert torch.equal(bias_swiglu(x, None), got)


def test_swiglu_gradients_float64():
    torch.manual_seed(6)
    x = torch.randn(3, 2, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (x,))
    assert torch.autograd.gradcheck(bias_swiglu, (x, bias))


def test_cpu_paths_are_the_references():
    """Off CUDA the public functions are their references, bit for bit, with use_fused on or off."""
    torch.manual_seed(7)
    x, w = torch.randn(6, 2, 32), torch.randn(32)
    t, freqs = torch.randn(6, 2, 2, 32), _freqs(6, 32)
    for fused in (True, False):
        assert torch.equal(rms_norm(x, w, 1e-5, use_fused=fused), ops.rms_norm_reference(x, w, 1e-5))
        assert torch.equal(apply_rotary_pos_emb(t, freqs, use_fused=fused), ops.apply_rotary_pos_emb_reference(t, freqs))
        assert torch.equal(swiglu(x, use_fused=fused), ops.swiglu_reference(x))
