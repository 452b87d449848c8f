"""Triton kernels for bias+GeLU and bias+dropout+residual-add, wrapped in autograd Functions.

Each kernel makes one pass over the tensor (fp32 arithmetic, output in the input dtype) instead of the two or
three passes of the eager PyTorch composition, and saves less for backward:

- bias+GeLU saves the GEMM output ``x`` (which the next GEMM does not need) and the bias, not ``x + bias``;
- bias+dropout+add never stores a dropout mask: the mask is regenerated in backward from a Philox seed drawn
  from the current CUDA generator (so the tensor-parallel RNG tracker and activation recomputation, which
  restore generator states, reproduce the same mask).

Import this module only when ``triton`` is importable; ``ops.py`` decides when to use it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, n_elements, H, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Y = gelu(X + B) for a contiguous X viewed as [n_elements / H, H]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % H, mask=mask, other=0.0).to(tl.float32)
    y = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, X, B, DX, n_elements, H, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """DX = DY * gelu'(X + B), with gelu'(z) = Phi(z) + z * phi(z)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % H, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
    tl.store(DX + offs, (dy * (cdf + z * pdf)).to(DX.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, _BLOCK),)


def _bias_grad(dz: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Sum of the gradient over every dimension but the last, accumulated in fp32, in the bias dtype."""
    if bias is None:
        return None
    return dz.reshape(-1, dz.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)


class BiasGeLUFunction(torch.autograd.Function):
    """gelu(x + bias) (exact erf GeLU) in one Triton pass forward and one backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        h = x.shape[-1]
        if n:
            _bias_gelu_fwd_kernel[_grid(n)](x, bias if bias is not None else x, y, n, h,
                                            HAS_BIAS=bias is not None, BLOCK=_BLOCK)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, bias) if bias is not None else ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.has_bias:
            x, bias = ctx.saved_tensors
        else:
            (x,), bias = ctx.saved_tensors, None
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        n = x.numel()
        if n:
            _bias_gelu_bwd_kernel[_grid(n)](dy, x, bias if bias is not None else x, dx, n, x.shape[-1],
                                            HAS_BIAS=bias is not None, BLOCK=_BLOCK)
        return dx, _bias_grad(dx, bias)


@triton.jit
def _bias_dropout_add_fwd_kernel(X, B, R, OUT, SEED, n_elements, H, p, scale,
                                 HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    """OUT = R + dropout(X + B); the keep mask is Philox(seed, element index) > p."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % H, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        seed = tl.load(SEED)
        keep = tl.rand(seed, offs) > p
        z = tl.where(keep, z * scale, 0.0)
    r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (r + z).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_bwd_kernel(DY, DX, SEED, n_elements, p, scale, BLOCK: tl.constexpr):
    """DX = DY * keep * scale with the forward's regenerated keep mask."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    seed = tl.load(SEED)
    keep = tl.rand(seed, offs) > p
    tl.store(DX + offs, tl.where(keep, dy * scale, 0.0).to(DX.dtype.element_ty), mask=mask)


class BiasDropoutAddFunction(torch.autograd.Function):
    """residual + dropout(x + bias) in one Triton pass; no mask is stored (regenerated from the seed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float,
                training: bool) -> torch.Tensor:
        if residual.shape != x.shape:
            raise ValueError(f"bias_dropout_add: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        x = x.contiguous()
        residual = residual.contiguous()
        dtypes = [x.dtype, residual.dtype] + ([bias.dtype] if bias is not None else [])
        out_dtype = dtypes[0]
        for d in dtypes[1:]:
            out_dtype = torch.promote_types(out_dtype, d)
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        dropout = bool(training) and prob > 0.0
        if dropout and prob >= 1.0:
            raise ValueError(f"dropout probability must be < 1, got {prob}")
        scale = 1.0 / (1.0 - prob) if dropout else 1.0
        # A fresh Philox seed per call from the current CUDA generator, kept on the device (no host sync).
        seed = (torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int32) if dropout
                else torch.zeros(1, device=x.device, dtype=torch.int32))
        n = x.numel()
        if n:
            _bias_dropout_add_fwd_kernel[_grid(n)](
                x, bias if bias is not None else x, residual, out, seed, n, x.shape[-1], float(prob), scale,
                HAS_BIAS=bias is not None, DROPOUT=dropout, BLOCK=_BLOCK)
        ctx.save_for_backward(seed)
        ctx.dropout, ctx.prob, ctx.scale = dropout, float(prob), scale
        ctx.x_dtype, ctx.r_dtype = x.dtype, residual.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        (seed,) = ctx.saved_tensors
        dout = dout.contiguous()
        if ctx.dropout:
            dz = torch.empty(dout.shape, dtype=ctx.x_dtype, device=dout.device)
            n = dout.numel()
            if n:
                _dropout_bwd_kernel[_grid(n)](dout, dz, seed, n, ctx.prob, ctx.scale, BLOCK=_BLOCK)
        else:
            dz = dout.to(ctx.x_dtype)
        dbias = None
        if ctx.bias_dtype is not None:
            dbias = dz.reshape(-1, dz.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dz, dbias, dout.to(ctx.r_dtype), None, None
