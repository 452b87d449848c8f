"""Triton kernels for the FP8 quantization of ``fp8.py``, three launches and two passes over the tensor:

1. ``_amax_kernel``: per-program maxima of ``|x|`` (a NaN counts as infinity) over a grid of a few programs per
   multiprocessor, each striding through the tensor;
2. ``_scale_kernel`` (one program): ``amax`` from those partials, then ``scale = fp8_max / 2**margin / amax`` and
   its inverse, by the rules of ``fp8.scales`` (amax 0: scale 1; non-finite amax: NaN), with IEEE division;
3. ``_scaled_cast_kernel``: scale, saturate and cast in one pass, writing the row-major FP8 copy and, when asked,
   its transpose from the same tile (the transposed copy is what the backward GEMMs read as a column-major
   operand).

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

from megatron.core.fusions._triton_elementwise import _sm_count, gelu_f32

# Launch configurations; bench/kernel_sweep.py --only fp8 times the alternatives (--apply-fp8 rewrites these lines).
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
def _scale_kernel(PART, NPART, SCALE, SCALE_INV, FMAX_OVER_MARGIN: tl.constexpr, FP32_MAX: tl.constexpr,
                  NPART_P2: tl.constexpr):
    idx = tl.arange(0, NPART_P2)
    amax = tl.max(tl.load(PART + idx, mask=idx < NPART, other=0.0), axis=0).to(tl.float32)
    numerator = (tl.zeros_like(amax) + FMAX_OVER_MARGIN).to(tl.float32)
    scale = tl.minimum(tl.math.div_rn(numerator, tl.maximum(amax, 1e-45).to(tl.float32)), FP32_MAX)
    scale = tl.where(amax > 0.0, scale, 1.0)
    scale = tl.where(amax < float("inf"), scale, float("nan"))
    tl.store(SCALE, scale)
    scale = scale.to(tl.float32)
    tl.store(SCALE_INV, tl.math.div_rn((tl.zeros_like(scale) + 1.0).to(tl.float32), scale))


@triton.jit
def _scaled_cast_kernel(X, B, Q, QT, SCALE, M, N, FMAX: tl.constexpr, ROWS: tl.constexpr, TRANSPOSE: tl.constexpr,
                        GELU: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Q = saturate(V * SCALE) for V = X or gelu(X + B) (X [M, N] row-major); QT [N, M] = Q^T when TRANSPOSE;
    Q itself is written only when ROWS."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    v = x.to(tl.float32)
    if GELU:
        if HAS_BIAS:
            v += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        v = gelu_f32(v).to(x.dtype).to(tl.float32)
    y = v * tl.load(SCALE)
    # saturate; a NaN (from a non-finite amax, see fp8.py) stays NaN so the overflow check sees it
    y = tl.minimum(tl.maximum(y, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX, propagate_nan=tl.PropagateNan.ALL)
    q = y.to(Q.dtype.element_ty)
    if ROWS:
        tl.store(Q + rows.to(tl.int64)[:, None] * N + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        qt = tl.trans(q)  # [BLOCK_N, BLOCK_M]
        tl.store(QT + cols.to(tl.int64)[:, None] * M + rows[None, :], qt, mask=tl.trans(mask))


def scales(x: torch.Tensor, dtype: torch.dtype, margin: int, gelu: bool = False, bias=None):
    """(scale, 1/scale), one-element fp32 tensors, for a contiguous ``x`` (or ``gelu(x + bias)``, ``x`` 2D; see
    ``fp8.scales``)."""
    numel, cfg = x.numel(), AMAX_CONFIG
    blocks = triton.cdiv(numel, cfg["block"])
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    nprog = max(1, min(blocks, cfg["programs_per_sm"] * _sm_count(index)))
    iters = triton.cdiv(blocks, nprog)
    nprog = triton.cdiv(blocks, iters) if blocks else 1
    part = torch.empty(nprog, device=x.device, dtype=torch.float32)
    _amax_kernel[(nprog,)](x, bias if bias is not None else x, part, numel, x.shape[-1] if x.dim() else 1, iters,
                           GELU=gelu, HAS_BIAS=bias is not None, BLOCK=cfg["block"], num_warps=cfg["num_warps"])
    # two allocations, not views of one: cuBLASLt wants its scale pointers aligned (a view at offset 1 is not)
    scale = torch.empty(1, device=x.device, dtype=torch.float32)
    scale_inv = torch.empty(1, device=x.device, dtype=torch.float32)
    _scale_kernel[(1,)](part, nprog, scale, scale_inv, FMAX_OVER_MARGIN=torch.finfo(dtype).max / 2.0 ** margin,
                        FP32_MAX=torch.finfo(torch.float32).max, NPART_P2=triton.next_power_of_2(nprog))
    return scale, scale_inv


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool, rows: bool = True,
                gelu: bool = False, bias=None):
    """(q [M, N] or None, q^T [N, M] or None) in ``dtype`` from a contiguous 2D ``x`` (or ``gelu(x + bias)``) and a
    one-element fp32 ``scale``; q is written when ``rows``, q^T when ``transpose``."""
    m, n = x.shape
    q = torch.empty((m, n), device=x.device, dtype=dtype) if rows else None
    qt = torch.empty((n, m), device=x.device, dtype=dtype) if transpose else None
    if q is None and qt is None:
        raise ValueError("scaled_cast: nothing to write (rows and transpose both off)")
    cfg = CAST_CONFIG
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]))
    _scaled_cast_kernel[grid](x, bias if bias is not None else x, q if rows else qt, qt if transpose else q, scale,
                              m, n, FMAX=torch.finfo(dtype).max, ROWS=rows, TRANSPOSE=transpose, GELU=gelu,
                              HAS_BIAS=bias is not None, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                              num_warps=cfg["num_warps"])
    return q, qt
