"""Every fused kernel against its PyTorch reference on random inputs, forward and backward (GPU only).

Tolerances (relative Frobenius error against the reference run in the same dtype): bf16 within 1e-2, fp32
within 1e-5. Run on the GPU machine with ``python -m pytest -q tests/gpu``; without CUDA the module is skipped.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from megatron.core.fusions import ops  # noqa: E402
from megatron.core.fusions.cross_entropy import cross_entropy_reference, fused_vocab_cross_entropy  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fused result"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _leaf(shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype).requires_grad_()


def _grads(fn, inputs, grad_out):
    for t in inputs:
        if t is not None:
            t.grad = None
    out = fn()
    out.backward(grad_out)
    return out.detach().clone(), [None if t is None else t.grad.detach().clone() for t in inputs]


def _assert_matches(fused, reference, inputs, grad_out, tol):
    """``fused()`` and ``reference()`` (closures over ``inputs``) agree within ``tol`` forward and in the gradients
    of every input that is not None; returns the fused output."""
    out_f, grads_f = _grads(fused, inputs, grad_out)
    out_r, grads_r = _grads(reference, inputs, grad_out)
    assert out_f.dtype == out_r.dtype and rel_err(out_f, out_r) < tol
    for gf, gr in zip(grads_f, grads_r):
        if gr is not None:
            assert rel_err(gf, gr) < tol
    return out_f


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    assert ops.HAVE_TRITON, "Triton must be importable on the GPU machine"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(128, 4, 1024), (37, 3, 300)])
def test_bias_gelu(dtype, with_bias, shape):
    x = _leaf(shape, dtype, 2.0)
    b = _leaf(shape[-1:], dtype) if with_bias else None
    g = torch.randn(shape, device="cuda", dtype=dtype)
    _assert_matches(lambda: ops.bias_gelu(x, b, use_fused=True), lambda: ops.bias_gelu_reference(x, b), [x, b], g,
                    TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("training", [True, False])
def test_bias_dropout_add_no_dropout_matches(dtype, training):
    shape = (256, 2, 768)
    x, b, r = _leaf(shape, dtype), _leaf(shape[-1:], dtype), _leaf(shape, dtype)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    p = 0.0 if training else 0.3  # eval mode ignores p
    out_f, grads_f = _grads(lambda: ops.bias_dropout_add(x, b, r, p, training, use_fused=True), [x, b, r], g)
    out_r, grads_r = _grads(lambda: ops.bias_dropout_add_reference(x, b, r, p, training), [x, b, r], g)
    assert rel_err(out_f, out_r) < TOL[dtype]
    for gf, gr in zip(grads_f, grads_r):
        assert rel_err(gf, gr) < TOL[dtype]


def test_bias_dropout_add_dropout_semantics():
    """With p > 0 the mask differs from F.dropout's; check the function it computes instead (fp32)."""
    shape, p = (512, 4, 256), 0.25
    x, b, r = _leaf(shape, torch.float32), _leaf(shape[-1:], torch.float32), _leaf(shape, torch.float32)
    g = torch.randn(shape, device="cuda")
    out, (gx, gb, gr) = _grads(lambda: ops.bias_dropout_add(x, b, r, p, True, use_fused=True), [x, b, r], g)
    z = (out - r.detach())
    kept = z != 0
    frac_dropped = 1 - kept.float().mean().item()
    assert abs(frac_dropped - p) < 0.01
    want = (x.detach() + b.detach()) / (1 - p)
    assert rel_err(z[kept], want[kept]) < 1e-5
    # backward regenerates exactly the forward's mask
    assert torch.equal(gx != 0, kept)
    assert rel_err(gx, torch.where(kept, g / (1 - p), 0.0)) < 1e-6
    assert rel_err(gb, gx.sum((0, 1))) < 1e-5
    assert torch.equal(gr, g)
    # fresh masks per call, reproducible from the generator state (what recomputation relies on)
    state = torch.cuda.get_rng_state()
    o1 = ops.bias_dropout_add(x, b, r, p, True).detach()
    o2 = ops.bias_dropout_add(x, b, r, p, True).detach()
    torch.cuda.set_rng_state(state)
    o3 = ops.bias_dropout_add(x, b, r, p, True).detach()
    assert not torch.equal(o1, o2)
    assert torch.equal(o1, o3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(512, 4, 2048), (33, 5, 768), (7, 1, 100)])
def test_layer_norm(dtype, zero_centered, with_bias, shape):
    h = shape[-1]
    x = _leaf(shape, dtype, 3.0)
    with torch.no_grad():
        x += 1.5  # non-zero mean
    w = _leaf((h,), dtype, 0.5)
    b = _leaf((h,), dtype) if with_bias else None
    g = torch.randn(shape, device="cuda", dtype=dtype)
    out_f, grads_f = _grads(lambda: ops.layer_norm(x, w, b, 1e-5, zero_centered, use_fused=True), [x, w, b], g)
    out_r, grads_r = _grads(lambda: ops.layer_norm_reference(x, w, b, 1e-5, zero_centered), [x, w, b], g)
    assert rel_err(out_f, out_r) < TOL[dtype]
    for gf, gr in zip(grads_f, grads_r):
        if gr is not None:
            # weight/bias grads sum over many rows: compare with a slightly looser bound in bf16 only
            assert rel_err(gf, gr) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("shape", [(256, 4, 50304), (9, 3, 1000)])
def test_fused_vocab_cross_entropy(dtype, inplace, shape):
    logits = (torch.randn(*shape, device="cuda") * 4).to(dtype)
    target = torch.randint(0, shape[-1], shape[:-1], device="cuda")
    target[0, 0] = -100  # ignored token
    dloss = torch.rand(shape[:-1], device="cuda")
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    la = fused_vocab_cross_entropy(a, target, inplace_backward=inplace)
    lb = cross_entropy_reference(b, target)
    assert la.dtype == torch.float32 and la.shape == target.shape
    assert rel_err(la, lb) < 1e-5  # both accumulate in fp32 from the same inputs
    assert la[0, 0].item() == 0.0
    la.backward(dloss)
    lb.backward(dloss)
    assert rel_err(a.grad, b.grad) < TOL[dtype]
    assert torch.all(a.grad[0, 0] == 0)


def test_fused_cross_entropy_chunked_fallback_matches_triton():
    """The chunked PyTorch path (CPU / no Triton) computes the same loss and gradient as the Triton path."""
    logits = torch.randn(64, 2, 5000, device="cuda", dtype=torch.bfloat16) * 3
    target = torch.randint(0, 5000, (64, 2), device="cuda")
    cpu = logits.float().cpu().requires_grad_()
    gpu = logits.float().clone().requires_grad_()
    lc = fused_vocab_cross_entropy(cpu, target.cpu(), chunk_bytes=4 * 5000 * 7, inplace_backward=False)
    lg = fused_vocab_cross_entropy(gpu, target, inplace_backward=False)
    assert rel_err(lc, lg.cpu()) < 1e-5
    lc.sum().backward()
    lg.sum().backward()
    assert rel_err(cpu.grad, gpu.grad.cpu()) < 1e-5


def test_fused_cross_entropy_peak_memory_is_lean():
    """Forward + backward allocate no fp32 s*b*V tensor: the extra peak stays well below one fp32 copy."""
    s, b, v = 1024, 4, 50304
    logits = torch.randn(s, b, v, device="cuda", dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (s, b), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fused_vocab_cross_entropy(logits, target)
    loss.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    fp32_copy = s * b * v * 4
    # in-place backward writes the gradient into the logits' storage; at most one bf16 copy may appear (when
    # autograd clones it into the leaf's .grad), never an fp32 one
    assert extra < 0.6 * fp32_copy, f"extra peak {extra / 2**20:.0f} MiB vs fp32 copy {fp32_copy / 2**20:.0f} MiB"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_linear(dtype, with_bias):
    """The recomputing GeLU+GEMM (Triton element-wise parts) against F.linear(gelu(x + b), W)."""
    from megatron.core.fusions import bias_gelu_linear

    x = _leaf((256, 4, 1024), dtype)
    b = _leaf((1024,), dtype) if with_bias else None
    w = _leaf((256, 1024), dtype, 0.05)
    g = torch.randn(256, 4, 256, device="cuda", dtype=dtype)
    out_f, grads_f = _grads(lambda: bias_gelu_linear(x, b, w), [x, b, w], g)
    out_r, grads_r = _grads(lambda: torch.nn.functional.linear(ops.bias_gelu_reference(x, b), w), [x, b, w], g)
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]  # fp32 GEMMs may run in TF32
    assert rel_err(out_f, out_r) < tol
    for gf, gr in zip(grads_f, grads_r):
        if gr is not None:
            assert rel_err(gf, gr) < tol


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_grad_accumulation_fusion(with_bias):
    """Weight grads land in the fp32 main_grad (accumulated over two calls); x and bias grads as F.linear's."""
    from megatron.core.fusions.linear import linear_with_grad_accumulation_fusion

    from megatron.core.grad_record import attach_main_grad

    w = torch.nn.Parameter(torch.randn(384, 256, device="cuda", dtype=torch.bfloat16) * 0.05)
    attach_main_grad(w, torch.randn(384, 256, device="cuda", dtype=torch.float32)).is_zero = False  # added to
    start = w.main_grad.clone()
    b = torch.nn.Parameter(torch.randn(384, device="cuda", dtype=torch.bfloat16)) if with_bias else None
    ref_w = w.detach().float().clone().requires_grad_()
    ref_b = b.detach().float().clone().requires_grad_() if with_bias else None
    for _ in range(2):
        x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(64, 4, 384, device="cuda", dtype=torch.bfloat16)
        out = linear_with_grad_accumulation_fusion(x, w, b)
        out.backward(g)
        xr = x.detach().float().requires_grad_()
        ref = torch.nn.functional.linear(xr, ref_w, ref_b)
        ref.backward(g.float())
        assert rel_err(out, ref) < 1e-2
        assert rel_err(x.grad, xr.grad) < 1e-2
    assert w.grad is None
    assert rel_err(w.main_grad - start, ref_w.grad) < 1e-2
    if with_bias:
        assert rel_err(b.grad, ref_b.grad) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16384, 768), (16384, 2304), (4099, 2048), (33, 100), (0, 64)])
def test_column_sum_and_bias_grad(dtype, shape):
    """The Triton column sum (bias gradients) against an fp32 sum, in the input dtype and in fp32."""
    from megatron.core.fusions._triton_elementwise import column_sum

    x = torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)
    ref = x.float().sum(0)
    for out in (column_sum(x, dtype), ops.bias_grad(x.view(1, *shape)), column_sum(x, torch.float32),
                ops.bias_grad(x, torch.float32)):
        assert out.shape == (shape[1],)
        if shape[0] == 0:
            assert torch.all(out == 0)
            continue
        assert rel_err(out, ref) < TOL[out.dtype]  # fp32 output: only the summation order differs
    assert column_sum(x, dtype).dtype == dtype and ops.bias_grad(x).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_with_residual(dtype):
    """The residual branch's gradient is added inside the fused LayerNorm backward: x's gradient through both
    uses (LayerNorm and residual) equals the reference's, where autograd adds them."""
    shape = (128, 4, 1024)
    x = _leaf(shape, dtype)
    w, b = _leaf(shape[-1:], dtype), _leaf(shape[-1:], dtype)
    g = torch.randn(shape, device="cuda", dtype=dtype)

    def run(fn):
        y, res = fn(x, w, b, 1e-5)
        return ops.bias_dropout_add(y * 3.0, None, res, 0.0, True, use_fused=False)

    out_f, grads_f = _grads(lambda: run(lambda *a: ops.layer_norm_with_residual(*a, use_fused=True)), [x, w, b], g)
    out_r, grads_r = _grads(lambda: run(lambda *a: (ops.layer_norm_reference(*a), a[0])), [x, w, b], g)
    assert rel_err(out_f, out_r) < TOL[dtype]
    for gf, gr in zip(grads_f, grads_r):
        assert rel_err(gf, gr) < TOL[dtype]


def test_column_sums_are_exact_on_repeat_and_in_a_cuda_graph():
    """The column sums and the bias+GeLU bias gradient (partial rows, then the finishing launch): many calls in a
    row, different widths, and replays of a captured CUDA graph must all give the reference sums."""
    from megatron.core.fusions import _triton_elementwise as te

    torch.manual_seed(11)
    shapes = [(16384, 768), (16384, 2304), (1000, 300), (4096, 3072), (333, 64)]
    xs = [torch.randn(s, device="cuda").bfloat16() for s in shapes]
    refs = [x.double().sum(0) for x in xs]
    for _ in range(20):
        for x, ref in zip(xs, refs):
            torch.testing.assert_close(te.column_sum(x, torch.float32).double(), ref, rtol=1e-5, atol=1e-3)
    x, dy = torch.randn(8192, 3072, device="cuda").bfloat16(), torch.randn(8192, 3072, device="cuda").bfloat16()
    b = torch.randn(3072, device="cuda").bfloat16()
    _, db0 = te.bias_gelu_backward(dy, x, b)
    z = x.double() + b.double()
    gelu_grad = 0.5 * (1 + torch.erf(z / 2 ** 0.5)) + z * torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5
    torch.testing.assert_close(db0.double(), (dy.double() * gelu_grad).sum(0), rtol=2e-2, atol=0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        te.column_sum(xs[0], torch.float32)  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            sums = [te.column_sum(x, torch.float32) for x in xs]
            _, db = te.bias_gelu_backward(dy, x, b)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(sums, refs):
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-3)
        assert torch.equal(db, db0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(512, 4, 2048), (33, 5, 768), (7, 1, 100), (64, 2, 8192)])
def test_rms_norm(dtype, zero_centered, shape):
    x = _leaf(shape, dtype, 3.0)
    w = _leaf(shape[-1:], dtype, 0.5)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    out_f = _assert_matches(lambda: ops.rms_norm(x, w, 1e-5, zero_centered, use_fused=True),
                            lambda: ops.rms_norm_reference(x, w, 1e-5, zero_centered), [x, w], g, TOL[dtype])
    assert out_f.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual(dtype):
    shape = (128, 4, 1024)
    x, w = _leaf(shape, dtype), _leaf(shape[-1:], dtype)
    g = torch.randn(shape, device="cuda", dtype=dtype)

    def run(fn):
        y, res = fn(x, w, 1e-5)
        return y * 3.0 + res

    _assert_matches(lambda: run(lambda *a: ops.rms_norm_with_residual(*a, use_fused=True)),
                    lambda: run(lambda *a: (ops.rms_norm_reference(*a), a[0])), [x, w], g, TOL[dtype])


def _rope_freqs(s, rot, interleaved, base=500000.0):
    inv = 1.0 / base ** (torch.arange(0, rot, 2, device="cuda", dtype=torch.float32) / rot)
    f = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv)
    f = torch.stack((f, f), -1).flatten(-2) if interleaved else torch.cat((f, f), -1)
    return f[:, None, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,rot", [((4096, 2, 8, 128), 128), ((37, 3, 5, 80), 40), ((16, 1, 2, 64), 64)])
def test_rotary_pos_emb(dtype, interleaved, shape, rot):
    t = _leaf(shape, dtype)
    freqs = _rope_freqs(shape[0], rot, interleaved)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    out_f, (gf,) = _grads(lambda: ops.apply_rotary_pos_emb(t, freqs, interleaved, use_fused=True), [t], g)
    out_r, (gr,) = _grads(lambda: ops.apply_rotary_pos_emb_reference(t, freqs, interleaved), [t], g)
    assert out_f.dtype == dtype and rel_err(out_f, out_r) < TOL[dtype]
    assert torch.equal(out_f[..., rot:], t.detach()[..., rot:])
    assert rel_err(gf, gr) < TOL[dtype]
    # a non-contiguous input (a slice of a fused QKV tensor) gives the same result
    qkv = torch.randn(shape[:-1] + (3 * shape[-1],), device="cuda", dtype=dtype)
    q = qkv[..., : shape[-1]]
    assert rel_err(ops.apply_rotary_pos_emb(q, freqs, interleaved),
                   ops.apply_rotary_pos_emb_reference(q, freqs, interleaved)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(256, 4, 2 * 2816), (37, 3, 2 * 300)])
def test_swiglu(dtype, with_bias, shape):
    x = _leaf(shape, dtype, 2.0)
    b = _leaf(shape[-1:], dtype) if with_bias else None
    g = torch.randn(shape[:-1] + (shape[-1] // 2,), device="cuda", dtype=dtype)
    out_f = _assert_matches(lambda: ops.bias_swiglu(x, b, use_fused=True), lambda: ops.bias_swiglu_reference(x, b),
                            [x, b], g, TOL[dtype])
    if not with_bias:
        assert torch.equal(ops.swiglu(x), out_f)
