"""The MLP's activation and second GEMM with the activation output recomputed in backward (activation-memory
saving). The activation is the GeLU or the SwiGLU (``activation="swiglu"``: ``x [..., 2f]``, the first half gating
the second); the text below speaks of the GeLU, the SwiGLU works the same way (its FP8 path quantizes the SwiGLU
output instead of fusing the activation into the quantization).

``bias_gelu_linear(x, bias, weight) == F.linear(gelu(x + bias), weight)`` but autograd keeps only ``x`` (the
first GEMM's output, which the GeLU backward needs anyway) instead of also keeping ``gelu(x + bias)``: 8 bytes
per token per hidden unit of a 4h MLP (``8 sbh`` per layer in bf16, a quarter of a layer's activations with flash
attention). Backward recomputes the GeLU once (one element-wise pass over ``[s, b, 4h]``), then runs the usual
two GEMMs and the fused GeLU backward. On CUDA the element-wise parts are the Triton kernels of
``_triton_elementwise``; elsewhere the PyTorch references. Under tensor parallelism ``weight`` is the
row-parallel shard ``[h, 4h/tp]`` and the result is the partial sum the caller reduces.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions import fp8, ops
from megatron.core.fusions.linear import accumulate_wgrad
from megatron.core.grad_record import fused_target


ACTIVATIONS = ("gelu", "swiglu")


def bias_activation(x: torch.Tensor, bias: Optional[torch.Tensor], activation: str, fused: bool) -> torch.Tensor:
    """``gelu(x + bias)`` or ``swiglu(x + bias)`` (with autograd)."""
    if activation == "gelu":
        return ops.bias_gelu(x, bias, use_fused=fused)
    return ops.bias_swiglu(x, bias, use_fused=fused)


def _act_forward(x: torch.Tensor, bias: Optional[torch.Tensor], activation: str, fused: bool) -> torch.Tensor:
    with torch.no_grad():
        if activation == "gelu" and fused:
            return ops.BiasGeLUFunction.apply(x, bias)
        if activation == "gelu":
            return ops.bias_gelu_reference(x, bias)
        return bias_activation(x, bias, activation, fused)


def _act_backward(x: torch.Tensor, bias: Optional[torch.Tensor], dg: torch.Tensor, activation: str, fused: bool):
    """(dx, dbias) of the activation of ``x + bias`` for the upstream gradient ``dg``."""
    if fused and activation == "gelu":
        return ops.bias_gelu_backward(dg, x, bias)
    xd = x.detach().requires_grad_()
    bd = bias.detach().requires_grad_() if bias is not None else None
    with torch.enable_grad():
        y = ops.bias_gelu_reference(xd, bd) if activation == "gelu" else bias_activation(xd, bd, activation, fused)
    grads = torch.autograd.grad(y, (xd,) if bd is None else (xd, bd), dg)
    return grads[0], (grads[1] if bd is not None else None)


class BiasActivationLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor, fused: bool,
                accumulate_into_main_grad: bool, fp8_format: Optional[str], fp8_margin: int, recompute: bool,
                fp8_sites=None, activation: str = "gelu"):
        ctx.fused, ctx.fp8_format, ctx.fp8_margin, ctx.fp8_sites = fused, fp8_format, fp8_margin, fp8_sites
        ctx.activation = activation
        # the GeLU alone is computed inside the FP8 quantization of the GEMM's input
        in_quant = fused and activation == "gelu"
        ctx.weight, ctx.accumulate_into_main_grad = weight, accumulate_into_main_grad
        ctx.has_bias, ctx.recompute = bias is not None, recompute
        saved = (x, bias, weight) if bias is not None else (x, weight)
        if fp8_format is None:
            g = _act_forward(x, bias, activation, fused)  # [s, b, ffn] temporary, freed after the GEMM
            out = F.linear(g, weight)  # [s, b, h] (partial under TP)
        else:  # FP8 GEMM on q(gelu(x + bias)): fused, the GeLU output is computed inside the quantization
            src = x if in_quant else _act_forward(x, bias, activation, fused and activation != "gelu")
            out2, (gqt, g_inv, wqt, w_inv) = fp8.fprop(src.reshape(-1, src.shape[-1]), weight, None, fp8_margin,
                                                       keep_x=not recompute and ctx.needs_input_grad[2],
                                                       gelu=in_quant, gelu_bias=bias if in_quant else None,
                                                       sites=fp8_sites)
            out = out2.view(*x.shape[:-1], weight.shape[0])
            # recomputing: the backward re-quantizes the GeLU output, so only q(W)^T is kept; else q(g)^T too
            saved = saved + ((wqt, w_inv) if recompute else (wqt, w_inv, gqt, g_inv))
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        saved = list(ctx.saved_tensors)
        x = saved.pop(0)
        bias = saved.pop(0) if ctx.has_bias else None
        weight = saved.pop(0)
        d2 = dout.reshape(-1, dout.shape[-1])  # [s*b, h]
        if ctx.fp8_format is not None:
            need_dw = ctx.needs_input_grad[2]
            wqt, w_inv, *kept = saved  # kept: q(g)^T and 1/s_g, unless the GeLU output is recomputed
            gq_t, g_inv = kept if kept else (None, None)
            in_quant = ctx.fused and ctx.activation == "gelu"
            if ctx.recompute and need_dw:  # only q(g)^T is needed (the weight-gradient GEMM's operand)
                src = x if in_quant else _act_forward(x, bias, ctx.activation,
                                                      ctx.fused and ctx.activation != "gelu")
                _, gq_t, g_inv = fp8.quantize(src.reshape(-1, src.shape[-1]), fp8.E4M3, ctx.fp8_margin,
                                              transpose=True, rows=False, gelu=in_quant,
                                              bias=bias if in_quant else None,
                                              site=ctx.fp8_sites[0] if ctx.fp8_sites is not None else None)
            dg2, dw = fp8.bprop(d2.contiguous(), (gq_t, g_inv, wqt, w_inv), ctx.fp8_format, ctx.fp8_margin,
                                need_dx=True, need_dw=need_dw,
                                accumulate_into=ctx.weight if ctx.accumulate_into_main_grad else None,
                                sites=ctx.fp8_sites)
            del gq_t
            dweight = dw.to(weight.dtype) if dw is not None else None
            dg = dg2.view(*x.shape[:-1], weight.shape[1])
        else:
            g = _act_forward(x, bias, ctx.activation, ctx.fused)  # recomputed [s, b, ffn]
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.accumulate_into_main_grad:
                # gradient-accumulation fusion: the weight-gradient GEMM adds into the fp32 buffer itself
                accumulate_wgrad(ctx.weight, d2, g2)
                dweight = None
            else:
                dweight = d2.t().matmul(g2).to(weight.dtype)  # [h, ffn]
            del g, g2
            dg = dout.matmul(weight)  # [s, b, ffn]
        dx, dbias = _act_backward(x, bias, dg, ctx.activation, ctx.fused)
        return dx, dbias, dweight, None, None, None, None, None, None, None


def bias_gelu_linear(x: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor,
                     use_fused: bool = True, gradient_accumulation_fusion: bool = False,
                     fp8_format: Optional[str] = None, fp8_margin: int = 0, recompute: bool = True,
                     fp8_sites=None) -> torch.Tensor:
    """``bias_activation_linear`` with the GeLU."""
    return bias_activation_linear(x, bias, weight, "gelu", use_fused, gradient_accumulation_fusion, fp8_format,
                                  fp8_margin, recompute, fp8_sites)


def bias_activation_linear(x: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor,
                           activation: str = "gelu", use_fused: bool = True,
                           gradient_accumulation_fusion: bool = False, fp8_format: Optional[str] = None,
                           fp8_margin: int = 0, recompute: bool = True, fp8_sites=None) -> torch.Tensor:
    """F.linear(act(x + bias), weight) keeping only ``x`` for backward (the activation output is recomputed);
    ``act`` is ``activation``: "gelu" or "swiglu" (``x [..., 2f]``, ``weight [h, f]``).

    With ``gradient_accumulation_fusion`` and an fp32 ``weight.main_grad`` on CUDA, the weight gradient is added
    into ``main_grad`` by the GEMM (see ``megatron.core.fusions.linear``) and ``weight.grad`` stays empty.
    With ``fp8_format`` the GEMMs run in FP8 (``megatron.core.fusions.fp8``); the weight gradient then goes
    into ``main_grad`` whenever the weight has an fp32 one and ``gradient_accumulation_fusion`` is set. The
    fused FP8 path computes the GeLU inside the quantization of the second GEMM's input, so its 16-bit output is
    never stored; ``recompute=False`` (FP8 only) keeps that input's FP8 transpose for backward instead of
    recomputing it (1 byte per element instead of the 2 a bf16 activation output would take). ``fp8_sites``: the
    second GEMM's delayed-scaling sites (``fp8.new_sites``), or None for tensorwise current scaling.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation}")
    fused = ops.fusable(x, use_fused) and (bias is None or bias.shape == x.shape[-1:])
    if fp8_format is not None:
        fp8.grad_dtype(fp8_format)  # validates the format
        if torch.compiler.is_compiling():
            raise RuntimeError("--fp8-format cannot run under torch.compile (use the eager transformer layer)")
        return BiasActivationLinearFunction.apply(x, bias, weight, fused, gradient_accumulation_fusion, fp8_format,
                                                  fp8_margin, recompute, fp8_sites, activation)
    if not recompute:
        raise ValueError("bias_activation_linear without recomputation is only for FP8 (use the activation and "
                         "a linear)")
    if torch.compiler.is_compiling():
        return F.linear(bias_activation(x, bias, activation, False), weight)
    accumulate = gradient_accumulation_fusion and x.is_cuda and fused_target(weight) is not None
    return BiasActivationLinearFunction.apply(x, bias, weight, fused, accumulate, None, 0, True, None, activation)
