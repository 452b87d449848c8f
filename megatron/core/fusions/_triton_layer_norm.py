"""Triton LayerNorm over the last dimension, forward and backward, with optional zero-centred gamma.

Forward: one program per row; mean and variance in fp32 from a single load of the row; saves the input, the
per-row mean and 1/std (8 bytes a row), never the normalised output.
Backward: each program walks a contiguous block of rows, writes dx row by row and accumulates dgamma/dbeta
partial sums in fp32 registers; the partials ([programs, h]) are summed by one reduction at the end.

With ``zero_centered_gamma`` the stored weight is ``gamma - 1`` and the kernel adds the 1 itself (the gradient
with respect to the stored weight equals the gradient with respect to gamma).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

_MAX_FUSED_BYTES = 65536


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _ln_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps,
                   HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _ln_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, stride, M, N, rows_per_program,
                   ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        live = mask & (row < M)  # the last program may run past the final row
        off = row.to(tl.int64) * stride
        x = tl.load(X + off + cols, mask=live, other=0.0).to(tl.float32)
        dy = tl.load(DY + off + cols, mask=live, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row, mask=row < M, other=0.0)
        rstd = tl.load(RSTD + row, mask=row < M, other=0.0)
        xhat = tl.where(live, (x - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=live)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(DW_PART + pid * N + cols, dw_acc, mask=mask)
    tl.store(DB_PART + pid * N + cols, db_acc, mask=mask)


def triton_layer_norm_supported(x: torch.Tensor) -> bool:
    """True when a row fits in one program (the fused kernels load a whole row at once)."""
    return x.shape[-1] * 4 <= _MAX_FUSED_BYTES and x.numel() > 0


# Launch choices (bench/kernel_sweep.py measures alternatives): warps per row program is the row's padded length
# divided by WARP_DIVISOR (1..16 warps); the backward runs BWD_PROGRAMS_PER_SM programs per multiprocessor.
LN_CONFIG = {"fwd_warp_divisor": 256, "bwd_warp_divisor": 256, "bwd_programs_per_sm": 16}


def _num_warps(block_n: int, divisor: int) -> int:
    return min(max(block_n // divisor, 1), 16)


class LayerNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last dimension."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                zero_centered_gamma: bool) -> torch.Tensor:
        n = x.shape[-1]
        if weight.numel() != n or (bias is not None and bias.numel() != n):
            raise ValueError(f"layer_norm: weight/bias size must equal the last dimension {n}")
        x2 = x.reshape(-1, n).contiguous()  # [M, N]
        m = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block_n = triton.next_power_of_2(n)
        _ln_fwd_kernel[(m,)](x2, weight, bias if bias is not None else weight, y, mean, rstd,
                             x2.stride(0), y.stride(0), n, float(eps),
                             HAS_BIAS=bias is not None, ZERO_CENTERED=bool(zero_centered_gamma),
                             BLOCK_N=block_n, num_warps=_num_warps(block_n, LN_CONFIG["fwd_warp_divisor"]))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias, ctx.zero_centered = bias is not None, bool(zero_centered_gamma)
        ctx.block_n, ctx.shape = block_n, x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = dy.reshape(m, n).contiguous()
        dx = torch.empty_like(x2)
        sms = _sm_count(x2.device.index if x2.device.index is not None else torch.cuda.current_device()) \
            if x2.is_cuda else 4
        programs = max(1, min(m, LN_CONFIG["bwd_programs_per_sm"] * sms))  # enough rows in flight
        rows_per_program = triton.cdiv(m, programs)
        programs = triton.cdiv(m, rows_per_program)
        dw_part = torch.empty(programs, n, dtype=torch.float32, device=x2.device)
        db_part = torch.empty(programs, n, dtype=torch.float32, device=x2.device)
        _ln_bwd_kernel[(programs,)](dy2, x2, weight, mean, rstd, dx, dw_part, db_part, x2.stride(0), m, n,
                                    rows_per_program, ZERO_CENTERED=ctx.zero_centered, BLOCK_N=ctx.block_n,
                                    num_warps=_num_warps(ctx.block_n, LN_CONFIG["bwd_warp_divisor"]))
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw, db, None, None
