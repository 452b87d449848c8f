"""Triton kernels for the FP8 quantization of ``fp8.py``: two launches and two passes over the tensor.

1. ``_amax_kernel``: per-program maxima of ``|x|`` (a NaN counts as infinity) over a grid of a few programs per
   multiprocessor, each striding through the tensor;
2. ``_scaled_cast_kernel``: every program first reduces those few hundred partial maxima (a few KB, read from
   L2) to ``amax`` and computes ``scale = fp8_max / 2**margin / amax`` by the rules of ``fp8.scales`` (amax 0:
   scale 1; non-finite amax: NaN; IEEE division), the first program also stores the scale and its inverse for
   the GEMM; then it scales, saturates and casts its tile, writing the row-major FP8 copy and, when asked, its
   transpose from the same tile (the transposed copy is what the backward GEMMs read as a column-major operand).

Computing the scale inside the cast saves a one-program launch per quantization (12 per transformer layer and
microbatch). ``scales`` (a separate one-program ``_scale_kernel``) and ``scaled_cast`` with a given scale remain
for callers that need the scale alone or cast with a scale of their own.

Delayed scaling (``--fp8-recipe delayed``) launches the cast alone: the scale comes from the site's history, and
each program atomically maxes the amax of its tile into the site's slot for the following steps (the current
scaling path records its amax the same way, once, when it belongs to a site).

With ``gelu=True`` both passes read the first MLP GEMM's output ``x`` and quantize ``gelu(x + bias)``, rounded to
``x``'s dtype first (so the result is the same as quantizing the output of the bias+GeLU kernel): the GeLU output
is never written in 16 bits. ``rows=False`` writes only the transposed copy (what the weight-gradient GEMM
reads).

Import only when ``triton`` is importable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.core.fusions._triton_elementwise import sm_count, gelu_f32

# Launch configurations; bench/kernel_sweep.py --only fp8 times the alternatives.
AMAX_CONFIG = {"block": 4096, "programs_per_sm": 4, "num_warps": 8}
CAST_CONFIG = {"block_m": 64, "block_n": 128, "num_warps": 8}


@triton.jit
def _amax_kernel(X, B, PART, NUMEL, N, ITERS, GELU: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """PART[pid] = max |X| (or |gelu(X + B)|, X viewed as [NUMEL / N, N]) over blocks pid*ITERS .. pid*ITERS +
    ITERS - 1 of the flattened X (NaN -> inf)."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, ITERS):
        offs = (tl.program_id(0) * ITERS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        x = tl.load(X + offs, mask=mask, other=0.0)
        v = x.to(tl.float32)
        if GELU:
            if HAS_BIAS:
                v += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
            v = gelu_f32(v).to(x.dtype).to(tl.float32)
        a = tl.abs(v)
        acc = tl.maximum(acc, tl.where(a == a, a, float("inf")))
    tl.store(PART + tl.program_id(0), tl.max(acc, axis=0))


@triton.jit
def _scale_from_parts(PART, NPART, FMAX_OVER_MARGIN: tl.constexpr, FP32_MAX: tl.constexpr, NPART_P2: tl.constexpr):
    """(scale, 1/scale, amax) in fp32 from the amax kernel's partial maxima."""
    idx = tl.arange(0, NPART_P2)
    amax = tl.max(tl.load(PART + idx, mask=idx < NPART, other=0.0), axis=0).to(tl.float32)
    numerator = (tl.zeros_like(amax) + FMAX_OVER_MARGIN).to(tl.float32)
    scale = tl.minimum(tl.math.div_rn(numerator, tl.maximum(amax, 1e-45).to(tl.float32)), FP32_MAX)
    scale = tl.where(amax > 0.0, scale, 1.0)
    scale = tl.where(amax < float("inf"), scale, float("nan")).to(tl.float32)
    return scale, tl.math.div_rn((tl.zeros_like(scale) + 1.0).to(tl.float32), scale), amax


@triton.jit
def _scale_kernel(PART, NPART, SCALE, SCALE_INV, FMAX_OVER_MARGIN: tl.constexpr, FP32_MAX: tl.constexpr,
                  NPART_P2: tl.constexpr):
    scale, scale_inv, amax = _scale_from_parts(PART, NPART, FMAX_OVER_MARGIN, FP32_MAX, NPART_P2)
    tl.store(SCALE, scale)
    tl.store(SCALE_INV, scale_inv)


@triton.jit
def _scaled_cast_kernel(X, B, Q, QT, SCALE, SCALE_INV, PART, NPART, AMAX_OUT, M, N, FMAX: tl.constexpr,
                        ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, GELU: tl.constexpr, HAS_BIAS: tl.constexpr,
                        FROM_PARTS: tl.constexpr, RECORD_AMAX: tl.constexpr, FMAX_OVER_MARGIN: tl.constexpr,
                        FP32_MAX: tl.constexpr, NPART_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Q = saturate(V * scale) for V = X or gelu(X + B) (X [M, N] row-major); QT [N, M] = Q^T when TRANSPOSE;
    Q itself is written only when ROWS. The scale is read from SCALE, or with FROM_PARTS computed from the
    amax kernel's partial maxima (and stored, with its inverse, by the first program). RECORD_AMAX: the amax of
    V (NaN counted as infinity) is atomically maxed into AMAX_OUT (delayed scaling's history)."""
    if FROM_PARTS:
        scale, scale_inv, amax = _scale_from_parts(PART, NPART, FMAX_OVER_MARGIN, FP32_MAX, NPART_P2)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(SCALE, scale)
            tl.store(SCALE_INV, scale_inv)
            if RECORD_AMAX:
                tl.atomic_max(AMAX_OUT, amax)
    else:
        scale = tl.load(SCALE)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    v = x.to(tl.float32)
    if GELU:
        if HAS_BIAS:
            v += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        v = gelu_f32(v).to(x.dtype).to(tl.float32)
    if RECORD_AMAX and not FROM_PARTS:
        a = tl.where(mask, tl.abs(v), 0.0)
        tl.atomic_max(AMAX_OUT, tl.max(tl.max(tl.where(a == a, a, float("inf")), axis=1), axis=0))
    y = v * scale
    # saturate; a NaN (from a non-finite amax, see fp8.py) stays NaN so the overflow check sees it
    y = tl.minimum(tl.maximum(y, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX, propagate_nan=tl.PropagateNan.ALL)
    q = y.to(Q.dtype.element_ty)
    if ROWS:
        tl.store(Q + rows.to(tl.int64)[:, None] * N + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        qt = tl.trans(q)  # [BLOCK_N, BLOCK_M]
        tl.store(QT + cols.to(tl.int64)[:, None] * M + rows[None, :], qt, mask=tl.trans(mask))


def _amax_parts(x: torch.Tensor, gelu: bool, bias) -> torch.Tensor:
    """The amax kernel's per-program maxima of a contiguous ``x`` (or ``gelu(x + bias)``, ``x`` 2D)."""
    numel, cfg = x.numel(), AMAX_CONFIG
    blocks = triton.cdiv(numel, cfg["block"])
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    nprog = max(1, min(blocks, cfg["programs_per_sm"] * sm_count(index)))
    iters = triton.cdiv(blocks, nprog)
    nprog = triton.cdiv(blocks, iters) if blocks else 1
    part = torch.empty(nprog, device=x.device, dtype=torch.float32)
    _amax_kernel[(nprog,)](x, bias if bias is not None else x, part, numel, x.shape[-1] if x.dim() else 1, iters,
                           GELU=gelu, HAS_BIAS=bias is not None, BLOCK=cfg["block"], num_warps=cfg["num_warps"])
    return part


def _scale_pair(x: torch.Tensor):
    # two allocations, not views of one: cuBLASLt wants its scale pointers aligned (a view at offset 1 is not)
    return (torch.empty(1, device=x.device, dtype=torch.float32),
            torch.empty(1, device=x.device, dtype=torch.float32))


def scales(x: torch.Tensor, dtype: torch.dtype, margin: int, gelu: bool = False, bias=None):
    """(scale, 1/scale), one-element fp32 tensors, for a contiguous ``x`` (or ``gelu(x + bias)``, ``x`` 2D; see
    ``fp8.scales``)."""
    part = _amax_parts(x, gelu, bias)
    scale, scale_inv = _scale_pair(x)
    _scale_kernel[(1,)](part, part.numel(), scale, scale_inv,
                        FMAX_OVER_MARGIN=torch.finfo(dtype).max / 2.0 ** margin,
                        FP32_MAX=torch.finfo(torch.float32).max, NPART_P2=triton.next_power_of_2(part.numel()))
    return scale, scale_inv


def quantize(x: torch.Tensor, dtype: torch.dtype, margin: int, transpose: bool, rows: bool = True,
             gelu: bool = False, bias=None, amax_out=None, scale=None, scale_inv=None):
    """(q or None, q^T or None, 1/scale) for a contiguous 2D ``x`` (or ``gelu(x + bias)``), as ``fp8.quantize``.

    Without ``scale``: its own current scale, from the amax kernel then the cast kernel, which computes the scale
    itself. With ``scale`` / ``scale_inv`` (delayed scaling): the cast kernel alone. ``amax_out``: a one-element
    fp32 tensor the amax of the quantized values is atomically maxed into."""
    if scale is not None:
        q, qt = _cast(x, scale, dtype, transpose, rows, gelu, bias, amax_out=amax_out)
        return q, qt, scale_inv
    part = _amax_parts(x, gelu, bias)
    scale, scale_inv = _scale_pair(x)
    q, qt = _cast(x, scale, dtype, transpose, rows, gelu, bias, scale_inv=scale_inv, part=part, margin=margin,
                  amax_out=amax_out)
    return q, qt, scale_inv


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool, rows: bool = True,
                gelu: bool = False, bias=None):
    """(q [M, N] or None, q^T [N, M] or None) in ``dtype`` from a contiguous 2D ``x`` (or ``gelu(x + bias)``) and a
    one-element fp32 ``scale``; q is written when ``rows``, q^T when ``transpose``."""
    return _cast(x, scale, dtype, transpose, rows, gelu, bias)


def _cast(x, scale, dtype, transpose, rows, gelu, bias, scale_inv=None, part=None, margin=0, amax_out=None):
    m, n = x.shape
    q = torch.empty((m, n), device=x.device, dtype=dtype) if rows else None
    qt = torch.empty((n, m), device=x.device, dtype=dtype) if transpose else None
    if q is None and qt is None:
        raise ValueError("scaled_cast: nothing to write (rows and transpose both off)")
    cfg = CAST_CONFIG
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]))
    from_parts = part is not None
    _scaled_cast_kernel[grid](x, bias if bias is not None else x, q if rows else qt, qt if transpose else q, scale,
                              scale_inv if from_parts else scale, part if from_parts else scale,
                              part.numel() if from_parts else 1, amax_out if amax_out is not None else scale, m, n,
                              FMAX=torch.finfo(dtype).max, ROWS=rows, TRANSPOSE=transpose, GELU=gelu,
                              HAS_BIAS=bias is not None, FROM_PARTS=from_parts, RECORD_AMAX=amax_out is not None,
                              FMAX_OVER_MARGIN=torch.finfo(dtype).max / 2.0 ** margin,
                              FP32_MAX=torch.finfo(torch.float32).max,
                              NPART_P2=triton.next_power_of_2(part.numel()) if from_parts else 1,
                              BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], num_warps=cfg["num_warps"])
    return q, qt
