"""Public element-wise ops used by the transformer layers, with their PyTorch references.

Each public op (``bias_gelu``, ``bias_dropout_add``, ``layer_norm``, ``rms_norm``, ``apply_rotary_pos_emb``,
``swiglu``) runs a fused Triton kernel when
``use_fused=True``, the tensor is on CUDA and Triton is importable, and otherwise the ``*_reference`` function,
which is the definition the fused kernels are tested against (tests/gpu/test_fused_kernels.py). ``bias_grad``
(the bias gradient of a linear layer, used by its autograd functions) has no switch: on CUDA with Triton it is
always the Triton column sum. While
``torch.compile`` traces a model (``--use-torch-compile``) the references are used too: Inductor fuses them
into its own kernels, and an opaque Triton call would only break the graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs fall back to the references.
    from megatron.core.fusions._triton_elementwise import (BiasDropoutAddFunction, BiasGeLUFunction,
                                                           BiasSwiGLUFunction, bias_gelu_backward, column_sum)
    from megatron.core.fusions._triton_layer_norm import (LayerNormFunction, triton_layer_norm_supported,
                                                          triton_rms_norm_supported)
    from megatron.core.fusions._triton_rope import RotaryFunction, triton_rope_supported

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False


def bias_gelu_reference(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu(x + bias) with the exact (erf) GeLU."""
    if bias is not None:
        x = x + bias
    return F.gelu(x)


def bias_dropout_add_reference(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float, training: bool
) -> torch.Tensor:
    """residual + dropout(x + bias)."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """LayerNorm over the last dimension; with zero-centred gamma the stored weight is gamma - 1."""
    w = weight + 1 if zero_centered_gamma else weight
    return F.layer_norm(x, (x.shape[-1],), w, bias, eps)


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or in its own dtype when that is wider (float64 for gradient checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered_gamma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * gamma`` computed in fp32 (gamma = weight, or
    weight + 1 with zero-centred gamma), returned in ``x``'s dtype."""
    xf = _at_least_fp32(x)
    w = _at_least_fp32(weight) + 1 if zero_centered_gamma else _at_least_fp32(weight)
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def rotate_half(t: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The 90-degree rotation of RoPE's channel pairs: ``[x1, x2] -> [-x2, x1]`` over the two halves of the last
    dimension, or over adjacent pairs ``(x[2i], x[2i+1])`` when ``interleaved``."""
    if interleaved:
        x1, x2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_reference(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding: ``t * cos(freqs) + rotate_half(t) * sin(freqs)`` on the first ``rot_dim =
    freqs.shape[-1]`` channels of ``t`` (computed in fp32), the remaining channels passed through; the result is
    in ``t``'s dtype. ``t`` is ``[s, b, n, d]``, ``freqs`` the fp32 angles ``[s, 1, 1, rot_dim]`` (each frequency
    twice: the two halves for the rotate-half layout, adjacent for ``interleaved``)."""
    rot = freqs.shape[-1]
    if rot % 2 or rot > t.shape[-1]:
        raise ValueError(f"rotary dimension {rot} must be even and at most the head dimension {t.shape[-1]}")
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    tf = _at_least_fp32(t_rot)
    f = freqs.to(tf.dtype)
    out = (tf * f.cos() + rotate_half(tf, interleaved) * f.sin()).to(t.dtype)
    return torch.cat((out, t_pass), dim=-1) if t_pass.shape[-1] else out


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate, up]`` split in two halves along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_swiglu_reference(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``swiglu(x + bias)``; ``bias`` is ``[2f]`` (the gate's and the up projection's biases)."""
    return swiglu_reference(x if bias is None else x + bias)


def _as_rows(dy: torch.Tensor) -> torch.Tensor:
    """``dy`` viewed as ``[-1, n]`` (also when it is empty)."""
    n = dy.shape[-1]
    return dy.reshape(dy.numel() // n if n else 0, n)


def bias_grad_reference(dy: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Column sums of ``dy`` viewed as ``[-1, dy.shape[-1]]`` in ``out_dtype`` (default ``dy.dtype``): exactly
    ``dy.reshape(-1, n).sum(0)`` for the default; a wider ``out_dtype`` is also the accumulation dtype."""
    out_dtype = dy.dtype if out_dtype is None else out_dtype
    return _as_rows(dy).sum(0, dtype=torch.promote_types(dy.dtype, out_dtype)).to(out_dtype)


def scaled_masked_softmax_reference(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(scores * scale with ``mask`` (True = masked out) set to -inf) in fp32, returned in the input dtype.

    Rows that are entirely masked give zeros (not NaN), as Megatron's fused softmax does.
    """
    x = scores.float() * scale
    if mask is not None:
        x = x.masked_fill(mask, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return torch.nan_to_num(probs, nan=0.0).to(scores.dtype)


class ScaledMaskedSoftmaxFunction(torch.autograd.Function):
    """The fused scale-mask-softmax semantics with 16-bit saved state.

    Computes in fp32 like the reference but keeps only the output, in the input dtype (2 bytes per attention
    score with bf16/fp16 instead of the 4 bytes autograd keeps for an fp32 softmax): the ``5as/h`` term of the
    paper's activation-memory formula instead of ``7as/h``. Backward: ``dx = scale * y * (dy - sum(dy * y))``.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        probs = scaled_masked_softmax_reference(scores, mask, scale)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, dprobs: torch.Tensor):
        (probs,) = ctx.saved_tensors
        y = probs.float()
        g = dprobs.float()
        dx = ctx.scale * y * (g - (g * y).sum(dim=-1, keepdim=True))
        return dx.to(probs.dtype), None, None


def scaled_masked_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                          use_fused: bool = True) -> torch.Tensor:
    """softmax(scale * scores, masked) for the unfused attention path; ``mask`` broadcasts to ``scores``
    (True = masked out, e.g. the upper-triangular causal mask, optionally OR-ed with a padding mask).

    ``use_fused=True`` (any device) keeps only the 16-bit probabilities for backward; otherwise autograd runs
    through the reference and keeps the fp32 ones.
    """
    if use_fused and not torch.compiler.is_compiling():
        return ScaledMaskedSoftmaxFunction.apply(scores, mask, float(scale))
    return scaled_masked_softmax_reference(scores, mask, scale)


def fusable(x: torch.Tensor, use_fused: bool) -> bool:
    """True when the fused Triton path applies: asked for, CUDA tensor, Triton present, not being traced."""
    return use_fused and HAVE_TRITON and x.is_cuda and not torch.compiler.is_compiling()


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], use_fused: bool = True) -> torch.Tensor:
    """gelu(x + bias) (the erf GeLU, not the tanh one), fused into one pass forward and one backward on CUDA (erf to
    within 1.5e-7 there, see ``_triton_elementwise.gelu_f32``)."""
    if fusable(x, use_fused) and (bias is None or bias.shape == x.shape[-1:]):
        return BiasGeLUFunction.apply(x, bias)
    return bias_gelu_reference(x, bias)


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float,
                     training: bool, use_fused: bool = True) -> torch.Tensor:
    """residual + dropout(x + bias); the fused path regenerates the dropout mask in backward instead of storing it.

    The fused path draws its Philox seed from the current CUDA generator, so forked RNG states (tensor-parallel
    regions) and recomputation reproduce the mask; the mask itself differs from ``F.dropout``'s.
    """
    if (fusable(x, use_fused) and residual.shape == x.shape
            and (bias is None or bias.shape == x.shape[-1:])):
        return BiasDropoutAddFunction.apply(x, bias, residual, float(prob), bool(training))
    return bias_dropout_add_reference(x, bias, residual, prob, training)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               zero_centered_gamma: bool = False, use_fused: bool = True) -> torch.Tensor:
    """LayerNorm over the last dimension (optionally zero-centred gamma), one Triton pass each way on CUDA."""
    if fusable(x, use_fused) and triton_layer_norm_supported(x):
        return LayerNormFunction.apply(x, weight, bias, eps, zero_centered_gamma)
    return layer_norm_reference(x, weight, bias, eps, zero_centered_gamma)


def layer_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                             zero_centered_gamma: bool = False, use_fused: bool = True):
    """``(layer_norm(x, ...), x)`` for a pre-LN layer whose residual branch starts at ``x``: fused, the residual
    gradient is added to the LayerNorm input gradient inside the backward kernel (``LayerNormFunction``);
    otherwise autograd adds the two gradients of ``x``."""
    if fusable(x, use_fused) and triton_layer_norm_supported(x):
        return LayerNormFunction.apply(x, weight, bias, eps, zero_centered_gamma, True)
    return layer_norm_reference(x, weight, bias, eps, zero_centered_gamma), x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False,
             use_fused: bool = True) -> torch.Tensor:
    """RMSNorm over the last dimension (``rms_norm_reference``), one Triton pass each way on CUDA."""
    if fusable(x, use_fused) and triton_rms_norm_supported(x):
        return LayerNormFunction.apply(x, weight, None, eps, zero_centered_gamma, False, True)
    return rms_norm_reference(x, weight, eps, zero_centered_gamma)


def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False,
                           use_fused: bool = True):
    """``(rms_norm(x, ...), x)`` for a pre-norm layer whose residual branch starts at ``x``; fused, the residual
    gradient is added inside the backward kernel (as ``layer_norm_with_residual``)."""
    if fusable(x, use_fused) and triton_rms_norm_supported(x):
        return LayerNormFunction.apply(x, weight, None, eps, zero_centered_gamma, True, True)
    return rms_norm_reference(x, weight, eps, zero_centered_gamma), x


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                         use_fused: bool = True) -> torch.Tensor:
    """Rotary position embedding of ``t [s, b, n, d]`` by the angles ``freqs [s, 1, 1, rot_dim]``
    (``apply_rotary_pos_emb_reference``); fused on CUDA, where backward applies the inverse rotation."""
    if fusable(t, use_fused) and triton_rope_supported(t, freqs):
        return RotaryFunction.apply(t, freqs, bool(interleaved))
    return apply_rotary_pos_emb_reference(t, freqs, interleaved)


def swiglu(x: torch.Tensor, use_fused: bool = True) -> torch.Tensor:
    """``silu(x[..., :f]) * x[..., f:]`` for ``x [..., 2f]`` (``swiglu_reference``); one Triton pass each way on
    CUDA, saving only ``x``."""
    if fusable(x, use_fused) and x.shape[-1] % 2 == 0:
        return BiasSwiGLUFunction.apply(x, None)
    return swiglu_reference(x)


def bias_swiglu(x: torch.Tensor, bias: Optional[torch.Tensor], use_fused: bool = True) -> torch.Tensor:
    """``swiglu(x + bias)`` with ``bias [2f]`` (or None: plain ``swiglu``)."""
    if fusable(x, use_fused) and x.shape[-1] % 2 == 0 and (bias is None or bias.shape == x.shape[-1:]):
        return BiasSwiGLUFunction.apply(x, bias)
    return bias_swiglu_reference(x, bias)


def bias_grad(dy: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The bias gradient of ``y = x W^T + b`` for the output gradient ``dy [..., n]``: the column sums of ``dy``
    viewed as ``[-1, n]``, accumulated in fp32 and returned in ``out_dtype`` (default ``dy.dtype``).

    On CUDA with Triton (and not while ``torch.compile`` traces) the Triton column sum
    (``_triton_elementwise.column_sum``); otherwise ``bias_grad_reference``.
    """
    out_dtype = dy.dtype if out_dtype is None else out_dtype
    if HAVE_TRITON and dy.is_cuda and not torch.compiler.is_compiling():
        return column_sum(_as_rows(dy), out_dtype)
    return bias_grad_reference(dy, out_dtype)
