"""FP8 linear layers on the GPU: the Triton cast against the PyTorch cast (bit for bit, both layouts), and the
cuBLAS FP8 GEMMs against an fp32 emulation on the dequantized operands (GPU with compute capability 8.9+)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an FP8 GPU (compute capability 8.9+)")

from megatron.core.fusions import fp8  # noqa: E402


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 300), (64, 8192)])
def test_triton_cast_equals_the_pytorch_cast(dtype, shape):
    assert fp8.HAVE_TRITON
    x = (torch.randn(*shape, device="cuda") * 7).bfloat16()
    x[0, 0] = 1e4  # saturates after scaling with a margin
    scale, _ = fp8.scales(x, dtype, margin=0)
    scale = scale * 2
    q, qt = fp8._triton_scaled_cast(x, scale, dtype, transpose=True)
    fmax = torch.finfo(dtype).max
    ref = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), ref.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype,margin", [(fp8.E4M3, 0), (fp8.E5M2, 0), (fp8.E4M3, 3)])
@pytest.mark.parametrize("numel", [1, 4095, 4096 * 3 + 17, 16384 * 2048])
def test_triton_scales_equal_the_pytorch_scales(dtype, margin, numel):
    x = (torch.randn(numel, device="cuda") * 5).bfloat16()
    got, ref = fp8.scales(x, dtype, margin), fp8._scales_torch(x, dtype, margin)
    for a, b in zip(got, ref):  # the same IEEE fp32 arithmetic (at most an ulp apart)
        torch.testing.assert_close(a, b, rtol=2.4e-7, atol=0)
    zero = fp8.scales(torch.zeros(numel, device="cuda"), dtype, margin)
    assert zero[0].item() == 1.0 and zero[1].item() == 1.0


@pytest.mark.parametrize("shape,with_bias", [((4096, 8192), True), ((1000, 304), True), ((64, 3072), False)])
def test_gelu_quantization_equals_quantizing_the_gelu_kernel_output(shape, with_bias):
    """quantize(gelu=True) computes the GeLU inside its two passes; the result must be bit for bit that of
    quantizing the bias+GeLU kernel's bf16 output, in both layouts and in the transposed-only mode."""
    from megatron.core.fusions.ops import BiasGeLUFunction

    torch.manual_seed(1)
    x = (torch.randn(*shape, device="cuda") * 3).bfloat16()
    b = torch.randn(shape[1], device="cuda").bfloat16() if with_bias else None
    ref_q, ref_qt, ref_inv = fp8.quantize(BiasGeLUFunction.apply(x, b), fp8.E4M3, 0, transpose=True)
    q, qt, inv = fp8.quantize(x, fp8.E4M3, 0, transpose=True, gelu=True, bias=b)
    assert torch.equal(inv, ref_inv)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), ref_qt.view(torch.uint8))
    none, qt_only, inv2 = fp8.quantize(x, fp8.E4M3, 0, transpose=True, rows=False, gelu=True, bias=b)
    assert none is None and torch.equal(inv2, ref_inv)
    assert torch.equal(qt_only.view(torch.uint8), ref_qt.view(torch.uint8))


def test_non_finite_input_gives_nan():
    x = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
    x[5, 7] = float("inf")
    q, qt, inv = fp8.quantize(x, fp8.E4M3, 0, transpose=True)
    assert torch.isnan(q.float()).all() and torch.isnan(qt.float()).all() and torch.isnan(inv).all()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("m,k,n", [(16384, 2048, 6144), (2048, 8192, 2048), (1024, 768, 2304)])
def test_gemms_match_an_fp32_emulation(fmt, m, k, n):
    torch.manual_seed(0)
    x = (torch.randn(m, k, device="cuda") * 3).bfloat16()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    b = torch.randn(n, device="cuda").bfloat16()
    dy = (torch.randn(m, n, device="cuda") * 1e-4).bfloat16()
    y, saved = fp8.fprop(x, w, b, margin=0, keep_x=True)
    xqt, x_inv, wqt, w_inv = saved
    xd, wd = xqt.t().float() * x_inv, wqt.t().float() * w_inv
    assert _rel(y, xd @ wd.t() + b.float()) < 1e-2  # fast accumulation + bf16 output
    dx, dw = fp8.bprop(dy, saved, fmt, 0, need_dx=True, need_dw=True)
    dyq, _, dy_inv = fp8.quantize(dy, fp8.grad_dtype(fmt), 0)
    dyd = dyq.float() * dy_inv
    assert _rel(dx, dyd @ wd) < 5e-3
    assert _rel(dw, dyd.t() @ xd) < 1e-3  # fp32 accumulation over thousands of tokens, in another order


@pytest.mark.parametrize("gelu", [False, True])
def test_delayed_scaling_triton_equals_the_pytorch_path(gelu):
    """--fp8-recipe delayed over three steps (current scaling at the first, then the recorded amax): the Triton
    cast with its in-kernel amax record gives the bits, scales and amax history of the PyTorch path."""
    from megatron.core.fusions.ops import BiasGeLUFunction

    torch.manual_seed(3)
    xs = [(torch.randn(1000, 304, device="cuda") * (2 + 3 * i)).bfloat16() for i in range(3)]
    b = torch.randn(304, device="cuda").bfloat16()
    runs = {}
    for triton_on in (True, False):
        fp8.reset_delayed_scaling()
        site = fp8.delayed_site(fp8.E5M2, 0, 2, "max")
        saved, fp8.HAVE_TRITON = fp8.HAVE_TRITON, triton_on
        try:
            out = []
            for x in xs:
                fp8.delayed_scaling_step()
                if gelu and not triton_on:  # the PyTorch path quantizes the bias+GeLU kernel's output
                    q, qt, inv = fp8.quantize(BiasGeLUFunction.apply(x, b), fp8.E5M2, 0, transpose=True, site=site)
                else:
                    q, qt, inv = fp8.quantize(x, fp8.E5M2, 0, transpose=True, gelu=gelu, bias=b if gelu else None,
                                              site=site)
                out += [q.view(torch.uint8), qt.view(torch.uint8), inv.clone(), fp8._DELAYED.history.clone()]
        finally:
            fp8.HAVE_TRITON = saved
        runs[triton_on] = out
    fp8.reset_delayed_scaling()
    for i, (a, r) in enumerate(zip(runs[True], runs[False])):
        assert torch.equal(a, r), f"output {i % 4} of step {i // 4 + 1} differs"
