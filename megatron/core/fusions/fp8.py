"""FP8 linear layers on ``torch._scaled_mm`` with per-tensor current scaling (no Transformer Engine needed).

``--fp8-format e4m3|hybrid`` runs the four GEMM layers of every transformer layer (QKV, projection, FC1, FC2)
in FP8; embeddings, LayerNorms, attention, the output layer and the loss stay in bf16/fp32, as with Transformer
Engine. The recipe is *tensorwise current scaling*: each GEMM operand is scaled by
``scale = fp8_max / amax / 2**margin`` computed from that tensor itself, just before its cast, so there is no
amax history to tune, keep in sync or checkpoint.

- ``e4m3``: activations, weights and output gradients in E4M3 (max 448).
- ``hybrid``: activations and weights in E4M3, output gradients in E5M2 (max 57344: range for gradients).

Per linear ``y = x W^T + b`` (``x [M, K]``, ``W [N, K]``):

- forward (fprop): ``y = (q(x) q(W)^T) / (s_x s_W) + b`` in the activation dtype, with fast accumulation;
- backward: ``dx = q(dy) q(W)`` (dgrad) and ``dW = q(dy)^T q(x)`` (wgrad), both with full-precision (split)
  accumulation, ``dW`` in fp32. With an fp32 ``weight.main_grad`` (the data-parallel wrapper's buffer) ``dW`` goes
  there and the weight gets no ``.grad`` (``grad_added_to_main_grad``, as with gradient-accumulation fusion):
  the GEMM writes it directly on the first microbatch after the wrapper zeroed the buffer
  (``main_grad_is_zero``), later microbatches add to it. Without one, ``dW`` is returned in the weight's dtype.

``_scaled_mm`` wants its first operand row-major and its second column-major, so the cast kernel writes a
transposed FP8 copy from the same tile where a backward GEMM needs one: saved for backward are ``q(x)^T`` (one
byte per element instead of the two of a bf16 ``x``) and ``q(W)^T``.

Overflow is not hidden: a non-finite amax makes the scale NaN, so the GEMM output is NaN and the optimizer's
non-finite-gradient check skips the step. GEMM dimensions (tokens per microbatch, hidden and FFN sizes per TP
rank) must be multiples of 16 (a cuBLAS FP8 requirement); anything else is refused with the sizes named.
On CUDA the cast is a Triton kernel; on CPU (tests) the same arithmetic in PyTorch ops.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core.fusions.main_grad import mark_added_to_main_grad
from megatron.core.fusions.ops import bias_gelu_reference, bias_grad

try:
    from megatron.core.fusions._triton_fp8 import quantize as _triton_quantize
    from megatron.core.fusions._triton_fp8 import scaled_cast as _triton_scaled_cast
    from megatron.core.fusions._triton_fp8 import scales as _triton_scales

    HAVE_TRITON = True
except ImportError:  # CPU-only machines without triton use the PyTorch cast below
    HAVE_TRITON = False

FP8_FORMATS = ("e4m3", "hybrid")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FP32_MAX = torch.finfo(torch.float32).max


def grad_dtype(fp8_format: str) -> torch.dtype:
    """The FP8 type of output gradients for a ``--fp8-format``."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"--fp8-format must be one of {', '.join(FP8_FORMATS)}, got {fp8_format}")
    return E5M2 if fp8_format == "hybrid" else E4M3


def scales(x: torch.Tensor, dtype: torch.dtype, margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) as one-element fp32 tensors: ``fp8_max / amax(|x|) / 2**margin``.

    amax 0 gives scale 1; a non-finite amax gives NaN (so the overflow reaches the non-finite-gradient check).
    Everything stays on the device: no host synchronisation (CUDA-graph safe). On CUDA two small Triton
    kernels (per-program maxima, then the scale); elsewhere PyTorch ops.
    """
    if HAVE_TRITON and x.is_cuda and x.is_contiguous():
        return _triton_scales(x, dtype, margin)
    return _scales_torch(x, dtype, margin)


def _scales_torch(x: torch.Tensor, dtype: torch.dtype, margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    amax = torch.linalg.vector_norm(x, ord=float("inf")).float().reshape(1)
    scale = torch.div(torch.full_like(amax, torch.finfo(dtype).max / 2.0 ** margin), amax)  # IEEE division
    scale = torch.where(amax > 0, scale.clamp(max=_FP32_MAX), torch.ones_like(amax))
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
    return scale, torch.div(torch.ones_like(scale), scale)


def quantize(x: torch.Tensor, dtype: torch.dtype, margin: int, transpose: bool = False, rows: bool = True,
             gelu: bool = False, bias: Optional[torch.Tensor] = None):
    """(q or None, q^T or None, 1/scale) for a 2D ``x``: ``q = saturate(v * scale)`` in ``dtype``, ``v = x``.

    ``rows`` / ``transpose`` choose which of q and q^T are made. With ``gelu`` it quantizes
    ``v = gelu(x + bias)`` (exact GeLU, rounded to ``x``'s dtype): on CUDA the Triton kernels compute the GeLU
    in both passes and never write it in 16 bits.
    """
    x = x.contiguous()  # the Triton kernels index a dense row-major tensor (a no-op for every caller here)
    if HAVE_TRITON and x.is_cuda:
        return _triton_quantize(x, dtype, margin, transpose, rows=rows, gelu=gelu, bias=bias)
    if gelu:
        x = bias_gelu_reference(x, bias)
    scale, scale_inv = scales(x, dtype, margin)
    fmax = torch.finfo(dtype).max
    q = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    return (q if rows else None), (q.t().contiguous() if transpose else None), scale_inv


def _check_dims(m: int, k: int, n: int) -> None:
    bad = [f"{name} {v}" for name, v in (("tokens", m), ("input features", k), ("output features", n)) if v % 16]
    if bad:
        raise ValueError(f"--fp8-format: FP8 GEMM sizes must be multiples of 16; this linear has {', '.join(bad)} "
                         f"(tokens = micro-batch x sequence length per rank; features per tensor-parallel rank)")


def _mm(a, b, scale_a, scale_b, out_dtype, bias=None, fast_accum=False, out=None) -> torch.Tensor:
    kw = {} if out is None else {"out": out}
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum, **kw)


def fprop(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], margin: int, keep_x: bool,
          gelu: bool = False, gelu_bias: Optional[torch.Tensor] = None):
    """``x2 [M, K] @ weight^T + bias`` in FP8 (``gelu(x2 + gelu_bias) @ weight^T + bias`` with ``gelu``, see
    ``quantize``). Returns (y [M, N], saved) where ``saved`` is what ``bprop`` needs: (q(x)^T or None when not
    ``keep_x``, 1/s_x, q(W)^T, 1/s_W)."""
    _check_dims(x2.shape[0], x2.shape[1], weight.shape[0])
    xq, xqt, x_inv = quantize(x2, E4M3, margin, transpose=keep_x, gelu=gelu, bias=gelu_bias)
    wq, wqt, w_inv = quantize(weight, E4M3, margin, transpose=True)
    y = _mm(xq, wq.t(), x_inv, w_inv, x2.dtype, bias=bias, fast_accum=True)
    return y, (xqt, x_inv, wqt, w_inv)


def bprop(dy2: torch.Tensor, saved, fp8_format: str, margin: int, need_dx: bool, need_dw: bool,
          accumulate_into: Optional[torch.Tensor] = None):
    """(dx [M, K] or None, dW [N, K] fp32 or None) for the upstream gradient ``dy2 [M, N]``.

    With ``accumulate_into`` (a weight with an fp32 ``main_grad``) the weight gradient goes into that buffer and
    None is returned for it: written by the GEMM itself when the data-parallel wrapper marked the buffer as
    freshly zeroed (``main_grad_is_zero``, the first microbatch of an iteration), else added to it.
    """
    xqt, x_inv, wqt, w_inv = saved
    dyq, dyqt, dy_inv = quantize(dy2, grad_dtype(fp8_format), margin, transpose=need_dw)
    dx = _mm(dyq, wqt.t(), dy_inv, w_inv, dy2.dtype) if need_dx else None
    if not need_dw:
        return dx, None
    main_grad = getattr(accumulate_into, "main_grad", None)
    if main_grad is None or main_grad.dtype != torch.float32:
        return dx, _mm(dyqt, xqt.t(), dy_inv, x_inv, torch.float32)
    if getattr(accumulate_into, "main_grad_is_zero", False):
        _mm(dyqt, xqt.t(), dy_inv, x_inv, torch.float32, out=main_grad)  # no read-add-write pass over fp32
    else:
        main_grad.add_(_mm(dyqt, xqt.t(), dy_inv, x_inv, torch.float32))
    mark_added_to_main_grad(accumulate_into)
    return dx, None


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fp8_format: str, margin: int, accumulate: bool):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        keep_x = ctx.needs_input_grad[1]  # q(x)^T is only needed for the weight gradient
        y, saved = fprop(x2, weight, bias, margin, keep_x=keep_x)
        ctx.save_for_backward(*(t for t in saved if t is not None))
        ctx.keep_x, ctx.weight, ctx.bias = keep_x, weight, bias
        ctx.fp8_format, ctx.margin, ctx.accumulate, ctx.has_bias = fp8_format, margin, accumulate, bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        saved = saved if ctx.keep_x else (None, *saved)
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = bprop(dy2, saved, ctx.fp8_format, ctx.margin, need_dx, need_dw,
                       accumulate_into=ctx.weight if ctx.accumulate else None)
        dbias = bias_grad(dy2, bias_param=ctx.bias) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dx = dx.view(*dy.shape[:-1], dx.shape[-1]) if dx is not None else None
        return dx, (dw.to(ctx.weight.dtype) if dw is not None else None), dbias, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fp8_format: str,
               margin: int = 0, accumulate_into_main_grad: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs in FP8 (see the module docstring)."""
    grad_dtype(fp8_format)  # validates the format
    if torch.compiler.is_compiling():
        raise RuntimeError("--fp8-format cannot run under torch.compile (use the eager transformer layer)")
    return Fp8LinearFunction.apply(x, weight, bias, fp8_format, margin, accumulate_into_main_grad)
