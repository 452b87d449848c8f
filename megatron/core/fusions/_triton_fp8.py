"""Triton kernel for the FP8 cast of ``fp8.py``: scale, saturate and cast a 2D tensor in one pass, writing the
row-major FP8 copy and, when asked, its transpose from the same tile (the transposed copy is what the backward
GEMMs read as a column-major operand). Import only when ``triton`` is importable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, NUM_WARPS = 64, 128, 8


@triton.jit
def _scaled_cast_kernel(X, Q, QT, SCALE, M, N, FMAX: tl.constexpr, TRANSPOSE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Q = saturate(X * SCALE) for X [M, N] row-major; QT [N, M] = Q^T when TRANSPOSE."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x * tl.load(SCALE)
    # saturate; a NaN (from a non-finite amax, see fp8.py) stays NaN so the overflow check sees it
    y = tl.minimum(tl.maximum(y, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX, propagate_nan=tl.PropagateNan.ALL)
    q = y.to(Q.dtype.element_ty)
    tl.store(Q + rows.to(tl.int64)[:, None] * N + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        qt = tl.trans(q)  # [BLOCK_N, BLOCK_M]
        tl.store(QT + cols.to(tl.int64)[:, None] * M + rows[None, :], qt, mask=tl.trans(mask))


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool):
    """(q [M, N], q^T [N, M] or None) in ``dtype`` from a contiguous 2D ``x`` and a one-element fp32 ``scale``."""
    m, n = x.shape
    q = torch.empty((m, n), device=x.device, dtype=dtype)
    qt = torch.empty((n, m), device=x.device, dtype=dtype) if transpose else q
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _scaled_cast_kernel[grid](x, q, qt, scale, m, n, FMAX=torch.finfo(dtype).max, TRANSPOSE=transpose,
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
    return q, (qt if transpose else None)
