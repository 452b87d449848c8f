"""Triton LayerNorm and RMSNorm over the last dimension, forward and backward, with optional zero-centred gamma.

Both kernels work on 2D tiles of ``BLOCK_M`` whole rows (``BLOCK_N`` >= the row length), so a program has
several rows' loads in flight and reduces them together; one row per step was latency-bound on narrow rows
(far below memory bandwidth at h = 768).

Forward: mean and variance in fp32 from a single load of each row; saves the input, the per-row mean and 1/std
(8 bytes a row), never the normalised output.
Backward: each program walks a contiguous run of row tiles, writes dx and accumulates dgamma/dbeta partial sums
in fp32 registers; the partials ([programs, h]) of both parameters are summed by one launch of the finishing
kernel (``sum_partial_rows_pair``).

RMSNorm (``rms=True``) is the same pair of kernels without the mean: ``y = x / sqrt(mean(x^2) + eps) * gamma``,
saving the input and 1/rms, and ``dx = (w dy - xhat mean(xhat w dy)) / rms``; there is no bias.

With ``zero_centered_gamma`` the stored weight is ``gamma - 1`` and the kernel adds the 1 itself (the gradient
with respect to the stored weight equals the gradient with respect to gamma).

``LN_CONFIG`` holds the launch choices, chosen with ``bench/kernel_sweep.py`` (which measures alternatives against
PyTorch's own LayerNorm on the GPU), and ``min_width``: the narrowest swept row length at which this kernel beat
PyTorch's (``ops.layer_norm`` uses PyTorch's kernel for narrower rows).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megatron.core.fusions._triton_elementwise import sm_count, sum_partial_rows, sum_partial_rows_pair

_MAX_BLOCK_N = 8192  # whole rows per tile: wider rows use PyTorch's kernel

# fwd: (elements per tile, num_warps); bwd: (elements per tile, num_warps, programs per multiprocessor)
LN_CONFIG = {"min_width": 768, "fwd": (2048, 2), "bwd": (4096, 8, 2)}


@triton.jit
def _ln_fwd_kernel(X, W, B, Y, MEAN, RSTD, M, N, eps, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                   RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x  # masked elements were loaded as 0
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    if not RMS:
        tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _ln_bwd_kernel(DY, X, W, MEAN, RSTD, DRES, DX, DW_PART, DB_PART, M, N, TILES, ZERO_CENTERED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # reduced over rows once, at the end
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, TILES):
        rows = (pid * TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        if RMS:
            xhat = x * rstd[:, None]  # masked elements were loaded as 0
        else:
            mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, axis=1) / N
        if RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_RES:  # the gradient reaching x through the residual branch, added here instead of by autograd
            dx += tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PART + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + cols, tl.sum(db_acc, axis=0), mask=cmask)


def triton_layer_norm_supported(x: torch.Tensor) -> bool:
    """True when rows are at least ``min_width`` wide and fit in one tile."""
    return max(1, LN_CONFIG["min_width"]) <= x.shape[-1] <= _MAX_BLOCK_N and x.numel() > 0


def triton_rms_norm_supported(x: torch.Tensor) -> bool:
    """True when rows fit in one tile (RMSNorm has no fused PyTorch kernel to prefer on narrow rows)."""
    return 0 < x.shape[-1] <= _MAX_BLOCK_N and x.numel() > 0


def _block_m(tile_elems: int, block_n: int) -> int:
    return max(1, tile_elems // block_n)


class LayerNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last dimension; with ``rms`` (and no bias) the
    RMSNorm y = x / sqrt(mean(x^2) + eps) * gamma.

    With ``residual_out`` it also returns ``x`` itself (a view), for the residual branch of a pre-LN layer: the
    gradient arriving there is then added to dx inside the backward kernel (one more read) instead of by
    autograd's separate add of the two gradients of ``x`` (two reads and a write).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                zero_centered_gamma: bool, residual_out: bool = False, rms: bool = False):
        n = x.shape[-1]
        if weight.numel() != n or (bias is not None and bias.numel() != n):
            raise ValueError(f"layer_norm: weight/bias size must equal the last dimension {n}")
        if rms and bias is not None:
            raise ValueError("rms_norm has no bias")
        x2 = x.reshape(-1, n).contiguous()  # [M, N]
        m = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        mean = rstd if rms else torch.empty(m, dtype=torch.float32, device=x.device)  # RMSNorm: never touched
        block_n = triton.next_power_of_2(n)
        tile_elems, warps = LN_CONFIG["fwd"]
        block_m = _block_m(tile_elems, block_n)
        _ln_fwd_kernel[(triton.cdiv(m, block_m),)](
            x2, weight, bias if bias is not None else weight, y, mean, rstd, m, n, float(eps),
            HAS_BIAS=bias is not None, ZERO_CENTERED=bool(zero_centered_gamma), RMS=bool(rms), BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias, ctx.zero_centered, ctx.rms = bias is not None, bool(zero_centered_gamma), bool(rms)
        ctx.block_n, ctx.shape = block_n, x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return (y.view(x.shape), x.view_as(x)) if residual_out else y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, dres: Optional[torch.Tensor] = None):
        x2, weight, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = dy.reshape(m, n).contiguous()
        dres2 = dres.reshape(m, n).contiguous() if dres is not None else None
        dx = torch.empty_like(x2)
        tile_elems, warps, per_sm = LN_CONFIG["bwd"]
        block_m = _block_m(tile_elems, ctx.block_n)
        sms = sm_count(x2.device.index if x2.device.index is not None else torch.cuda.current_device()) \
            if x2.is_cuda else 4
        row_tiles = triton.cdiv(m, block_m)
        programs = max(1, min(row_tiles, per_sm * sms))
        tiles = triton.cdiv(row_tiles, programs)
        programs = triton.cdiv(row_tiles, tiles)
        dw_part = torch.empty(programs, n, dtype=torch.float32, device=x2.device)
        db_part = torch.empty(programs, n, dtype=torch.float32, device=x2.device) if ctx.has_bias else dw_part
        _ln_bwd_kernel[(programs,)](dy2, x2, weight, mean, rstd, dres2 if dres2 is not None else dy2, dx, dw_part,
                                    db_part, m, n, tiles, ZERO_CENTERED=ctx.zero_centered, HAS_BIAS=ctx.has_bias,
                                    HAS_RES=dres2 is not None, RMS=ctx.rms, BLOCK_M=block_m, BLOCK_N=ctx.block_n,
                                    num_warps=warps)
        if ctx.has_bias:  # gamma's and beta's gradients finished in one launch
            dw, db = sum_partial_rows_pair(dw_part, weight.dtype, db_part, ctx.bias_dtype)
        else:
            dw, db = sum_partial_rows(dw_part, weight.dtype), None
        return dx.view(ctx.shape), dw, db, None, None, None, None
