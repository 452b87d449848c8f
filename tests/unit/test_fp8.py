"""FP8 linear layers (megatron/core/fusions/fp8.py) on CPU, where torch._scaled_mm runs the same arithmetic.

The GEMMs are checked against an fp32 emulation on the dequantized operands (what FP8 GEMMs compute, up to
accumulation order and the bf16 rounding of the outputs), the scaling rules against their definition, and the
whole layer against the bf16 ``F.linear`` within FP8 precision.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fp8
from megatron.core.fusions.mlp import bias_activation_linear, bias_gelu_linear
from megatron.core.fusions.ops import bias_gelu_reference


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _deq(q, inv):
    return q.float() * inv


def _operands(m=64, k=96, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    dy = (torch.randn(m, n, generator=g) * 1e-3).bfloat16()
    return x, w, b, dy


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_scale_maps_amax_to_the_format_maximum(dtype):
    x = torch.randn(32, 64).bfloat16()
    q, qt, inv = fp8.quantize(x, dtype, margin=0, transpose=True)
    fmax = torch.finfo(dtype).max
    assert q.dtype == dtype and q.float().abs().max().item() == fmax
    assert torch.equal(qt, q.t().contiguous())
    assert inv.item() == pytest.approx(x.float().abs().max().item() / fmax, rel=1e-6)
    q2, _, inv2 = fp8.quantize(x, dtype, margin=2)
    assert q2.float().abs().max().item() == fmax / 4 and inv2.item() == pytest.approx(4 * inv.item(), rel=1e-6)
    # dequantized values carry the format's relative precision (3 or 2 mantissa bits)
    assert _rel(_deq(q, inv), x.float()) < (0.04 if dtype == fp8.E4M3 else 0.08)


def test_zero_and_non_finite_amax():
    q, _, inv = fp8.quantize(torch.zeros(16, 16), fp8.E4M3, 0)
    assert inv.item() == 1.0 and not q.float().any()
    x = torch.ones(16, 16)
    x[3, 4] = float("inf")
    q, _, inv = fp8.quantize(x, fp8.E4M3, 0)
    assert torch.isnan(inv).all() and torch.isnan(q.float()).all()  # overflow is visible, not flushed to zero


def test_gemms_match_an_fp32_emulation_on_dequantized_operands():
    x, w, b, dy = _operands()
    y, saved = fp8.fprop(x, w, b, margin=0, keep_x=True)
    xqt, x_inv, wqt, w_inv = saved
    xd, wd = _deq(xqt.t(), x_inv), _deq(wqt.t(), w_inv)
    assert y.dtype == torch.bfloat16
    assert _rel(y, xd @ wd.t() + b.float()) < 5e-3  # bf16 rounding of the output
    for fmt, gdtype in (("e4m3", fp8.E4M3), ("hybrid", fp8.E5M2)):
        dx, dw = fp8.bprop(dy, saved, fmt, 0, need_dx=True, need_dw=True)
        dyq, _, dy_inv = fp8.quantize(dy, gdtype, 0)
        dyd = _deq(dyq, dy_inv)
        assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
        assert _rel(dx, dyd @ wd) < 5e-3
        assert _rel(dw, dyd.t() @ xd) < 1e-5


@pytest.mark.parametrize("fmt,fwd_tol,bwd_tol", [("e4m3", 0.03, 0.06), ("hybrid", 0.03, 0.1)])
def test_fp8_linear_tracks_the_bf16_linear(fmt, fwd_tol, bwd_tol):
    x, w, b, dy = _operands(m=128, k=64, n=96, seed=1)
    x3 = x.view(4, 32, 64).requires_grad_()
    w_, b_ = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = fp8.fp8_linear(x3, w_, b_, fmt)
    y.backward(dy.view(4, 32, 96))
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x3, w, b))
    yr = F.linear(xr, wr, br)
    yr.backward(dy.view(4, 32, 96).float())
    assert y.shape == (4, 32, 96)
    assert _rel(y, yr) < fwd_tol
    assert _rel(x3.grad, xr.grad) < bwd_tol and _rel(w_.grad, wr.grad) < bwd_tol
    assert torch.allclose(b_.grad.float(), br.grad, rtol=1e-2, atol=1e-4)  # bias grad is not quantized


def test_weight_gradient_goes_into_main_grad():
    from megatron.core.grad_record import attach_main_grad

    x, w, b, dy = _operands()
    x.requires_grad_()
    ref = w.clone().requires_grad_()
    fp8.fp8_linear(x, ref, None, "hybrid", accumulate_into_main_grad=False).backward(dy)
    dw = ref.grad.float()
    w_ = w.clone().requires_grad_()
    record = attach_main_grad(w_, torch.full(w.shape, 0.5))
    record.is_zero = False  # holds an earlier microbatch's gradient: added to
    fp8.fp8_linear(x, w_, None, "hybrid", accumulate_into_main_grad=True).backward(dy)
    assert w_.grad is None
    assert torch.allclose(w_.main_grad - 0.5, dw, rtol=1e-2, atol=1e-6)
    # marked zero by the DP wrapper: the GEMM writes the gradient itself (whatever the buffer held), once
    w_.main_grad.fill_(7.0)
    record.is_zero = True
    fp8.fp8_linear(x, w_, None, "hybrid", accumulate_into_main_grad=True).backward(dy)
    assert not record.is_zero and torch.allclose(w_.main_grad, dw, rtol=1e-2, atol=1e-6)
    fp8.fp8_linear(x, w_, None, "hybrid", accumulate_into_main_grad=True).backward(dy)  # second microbatch adds
    assert torch.allclose(w_.main_grad, 2 * dw, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_activation_linear_paths_equal_the_plain_fp8_composition(activation, recompute):
    """The MLP's second GEMM under FP8 with its activation (GeLU, or SwiGLU on [gate; up]), recomputing the
    activation in backward or keeping q(g)^T, against the activation + fp8_linear."""
    g = torch.Generator().manual_seed(3)
    width = 256 if activation == "swiglu" else 128
    x = torch.randn(2, 16, width, generator=g).bfloat16()
    bias = torch.randn(width, generator=g).bfloat16()
    w = (torch.randn(64, 128, generator=g) * 0.05).bfloat16()
    dout = torch.randn(2, 16, 64, generator=g).bfloat16()
    outs, grads = [], []
    for fused_path in (True, False):
        xi, bi, wi = (t.clone().requires_grad_() for t in (x, bias, w))
        if fused_path and activation == "gelu":
            out = bias_gelu_linear(xi, bi, wi, use_fused=False, fp8_format="hybrid", recompute=recompute)
        elif fused_path:
            out = bias_activation_linear(xi, bi, wi, "swiglu", use_fused=False, fp8_format="hybrid",
                                         recompute=recompute)
        elif activation == "gelu":
            out = fp8.fp8_linear(bias_gelu_reference(xi, bi), wi, None, "hybrid")
        else:
            gate, up = (xi + bi).chunk(2, dim=-1)
            out = fp8.fp8_linear(torch.nn.functional.silu(gate) * up, wi, None, "hybrid")
        out.backward(dout)
        outs.append(out)
        grads.append([t.grad for t in (xi, bi, wi)])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_sizes_that_are_not_multiples_of_16_are_named():
    x = torch.randn(10, 32).bfloat16()
    with pytest.raises(ValueError, match="multiples of 16; this linear has tokens 10"):
        fp8.fp8_linear(x, torch.randn(48, 32).bfloat16(), None, "e4m3")
    with pytest.raises(ValueError, match="--fp8-format must be one of e4m3, hybrid, got e5m2"):
        fp8.fp8_linear(x, torch.randn(48, 32).bfloat16(), None, "e5m2")


@pytest.fixture
def delayed():
    fp8.reset_delayed_scaling()
    yield
    fp8.reset_delayed_scaling()


def _cast_ref(x, scale, dtype):
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def test_delayed_scaling_uses_the_previous_steps_amax(delayed):
    """Step 1 scales by the current amax (no history yet) and records it; from step 2 on each cast uses the
    scale of the amax recorded in the step before, saturating what exceeds it, and records its own."""
    site = fp8.delayed_site(fp8.E4M3, 0, 1, "most_recent")
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(32, 48, generator=g) * s).bfloat16() for s in (2.0, 8.0, 1.0)]
    amax = [x.float().abs().max() for x in xs]
    for i, x in enumerate(xs):
        fp8.delayed_scaling_step()
        q, qt, inv = fp8.quantize(x, fp8.E4M3, 0, transpose=True, site=site)
        scale = torch.div(torch.tensor([448.0]), (amax[i] if i == 0 else amax[i - 1]).reshape(1))
        assert torch.equal(inv, torch.div(torch.ones(1), scale))
        ref = _cast_ref(x, scale, fp8.E4M3)
        assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
        assert torch.equal(qt.view(torch.uint8), ref.t().contiguous().view(torch.uint8))
        assert fp8._DELAYED.history[0, site].item() == amax[i].item()
        if i == 1:  # a tensor ~4x larger than the amax of step 1: its largest values saturate at 448
            assert (q.float().abs() == 448).sum() > 10


def test_delayed_scaling_history_max_and_bad_amax_keep_the_scale(delayed):
    site = fp8.delayed_site(fp8.E5M2, 1, 3, "max")
    fmax = torch.finfo(fp8.E5M2).max / 2.0
    for value in (4.0, 16.0, 2.0):
        fp8.delayed_scaling_step()
        fp8.quantize(torch.full((16, 16), value).bfloat16(), fp8.E5M2, 1, site=site)
    fp8.delayed_scaling_step()  # history 2, 16, 4 (newest first): the max is 16
    _, _, inv = fp8.quantize(torch.ones(16, 16).bfloat16(), fp8.E5M2, 1, site=site)
    assert inv.item() == pytest.approx(16.0 / fmax, rel=1e-7)
    x = torch.ones(16, 16).bfloat16()
    x[3, 3] = float("inf")
    fp8.quantize(x, fp8.E5M2, 1, site=site)  # this step's amax is infinite
    for _ in range(4):  # three steps see the infinite amax in the history, the fourth an empty one (0)
        fp8.delayed_scaling_step()
        assert fp8._DELAYED.scale[site, 0].item() == pytest.approx(fmax / 16.0, rel=1e-7)


def test_delayed_sites_of_one_process_share_one_setting(delayed):
    fp8.delayed_site(fp8.E4M3, 0, 2, "max")
    with pytest.raises(ValueError, match="already configured"):
        fp8.delayed_site(fp8.E4M3, 0, 1, "max")
    with pytest.raises(ValueError, match="history-len must be >= 1"):
        fp8.reset_delayed_scaling() or fp8.delayed_site(fp8.E4M3, 0, 0, "max")


def test_delayed_scaling_state_round_trip_and_mismatches(delayed):
    sites = [fp8.delayed_site(fp8.E4M3, 0, 2, "max"), fp8.delayed_site(fp8.E5M2, 0, 2, "max")]
    assert fp8.delayed_scaling_state() is None  # nothing quantized yet
    for value in (3.0, 5.0):
        fp8.delayed_scaling_step()
        for site, dtype in zip(sites, (fp8.E4M3, fp8.E5M2)):
            fp8.quantize(torch.full((16, 16), value).bfloat16(), dtype, 0, site=site)
    saved = fp8.delayed_scaling_state()
    assert saved["history"].device.type == "cpu" and saved["state"] == [fp8.DelayedScaling.READY] * 2
    fp8.reset_delayed_scaling()
    for _ in range(2):
        fp8.delayed_site(fp8.E4M3, 0, 2, "max")  # E4M3 twice: the second site's format differs
    assert "other formats or margins" in fp8.load_delayed_scaling_state(saved, torch.device("cpu"))
    fp8.reset_delayed_scaling()
    fp8.delayed_site(fp8.E4M3, 0, 1, "max"), fp8.delayed_site(fp8.E5M2, 0, 1, "max")
    assert "--fp8-amax-history-len 2" in fp8.load_delayed_scaling_state(saved, torch.device("cpu"))
    fp8.reset_delayed_scaling()
    restored = [fp8.delayed_site(fp8.E4M3, 0, 2, "max"), fp8.delayed_site(fp8.E5M2, 0, 2, "max")]
    assert fp8.load_delayed_scaling_state(saved, torch.device("cpu")) is None
    fp8.delayed_scaling_step()  # the same scales as the saved run's next step: max(5, 3) over the history
    _, _, inv = fp8.quantize(torch.ones(16, 16).bfloat16(), fp8.E4M3, 0, site=restored[0])
    assert inv.item() == pytest.approx(5.0 / 448.0, rel=1e-7)
