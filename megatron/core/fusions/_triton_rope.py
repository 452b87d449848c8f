"""Triton rotary position embedding, forward and backward, for ``t [s, b, n, d]`` and angles ``[s, 1, 1, rot]``.

One pass over ``t``: each program rotates ``BLOCK_M`` rows (one row = one head of one token) and copies their
channels beyond ``rot`` unchanged. ``t`` may be a strided view (the query or key slice of a fused QKV output)
as long as its channels are contiguous: it is read in place, not copied first; the output is contiguous. The cosines and sines of the ``[s, rot]`` angles are computed once per call by
PyTorch (``s * rot`` values, ``b * n`` times fewer than ``t``), so they are exactly the reference's, also for the
large angles of long sequences where the GPU's fast sine loses accuracy; the kernel computes in fp32 and writes
``t``'s dtype.

Channel pairs: ``(i, i + rot/2)`` in the rotate-half layout, ``(2i, 2i + 1)`` interleaved. With ``c1, s1`` the
cosine and sine of the first channel's angle and ``c2, s2`` of the second's, forward is
``(x1 c1 - x2 s1, x2 c2 + x1 s2)`` and backward its transpose ``(g1 c1 + g2 s2, g2 c2 - g1 s1)`` (the inverse
rotation when both angles are equal), the same kernel with the sines swapped and negated.

``ROPE_CONFIG`` holds the launch parameters, swept by ``bench/kernel_sweep.py --only rope``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# rows (token x head) per program, and warps per program
ROPE_CONFIG = {"block_m": 8, "num_warps": 4}


@triton.jit
def _rope_kernel(T, COS, SIN, OUT, M, B, N, STRIDE_S, STRIDE_B, STRIDE_N, D, ROT, HALF, INTERLEAVED: tl.constexpr,
                 BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # row = (position, batch, head), heads innermost
    rmask = rows < M
    pos = rows // (B * N)
    i = tl.arange(0, BLOCK_H)
    if INTERLEAVED:
        c1_idx = 2 * i
        c2_idx = 2 * i + 1
    else:
        c1_idx = i
        c2_idx = i + HALF
    mask = rmask[:, None] & (i < HALF)[None, :]
    r64 = rows.to(tl.int64)
    src = (pos.to(tl.int64) * STRIDE_S + (r64 // N % B) * STRIDE_B + (r64 % N) * STRIDE_N)[:, None]
    base = r64[:, None] * D
    fbase = pos.to(tl.int64)[:, None] * ROT
    x1 = tl.load(T + src + c1_idx[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(T + src + c2_idx[None, :], mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(COS + fbase + c1_idx[None, :], mask=mask, other=0.0)
    cos2 = tl.load(COS + fbase + c2_idx[None, :], mask=mask, other=0.0)
    sin1 = tl.load(SIN + fbase + c1_idx[None, :], mask=mask, other=0.0)
    sin2 = tl.load(SIN + fbase + c2_idx[None, :], mask=mask, other=0.0)
    if BACKWARD:  # the transposed rotation
        tmp = sin1
        sin1 = -sin2
        sin2 = -tmp
    tl.store(OUT + base + c1_idx[None, :], (x1 * cos1 - x2 * sin1).to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + base + c2_idx[None, :], (x2 * cos2 + x1 * sin2).to(OUT.dtype.element_ty), mask=mask)
    if BLOCK_P > 0:  # the channels beyond the rotary dimension pass through
        p = ROT + tl.arange(0, BLOCK_P)
        pmask = rmask[:, None] & (p < D)[None, :]
        tl.store(OUT + base + p[None, :], tl.load(T + src + p[None, :], mask=pmask, other=0.0), mask=pmask)


def triton_rope_supported(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """True for ``t [s, b, n, d]`` and ``freqs [s, 1, 1, rot]`` with an even ``rot <= d``."""
    rot = freqs.shape[-1]
    return (t.dim() == 4 and freqs.dim() == 4 and freqs.shape[0] == t.shape[0] and freqs.shape[1:3] == (1, 1)
            and 0 < rot <= t.shape[-1] and rot % 2 == 0 and t.numel() > 0)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    s, b, n, d = t.shape
    rot = cos.shape[-1]
    out = torch.empty((s, b, n, d), dtype=t.dtype, device=t.device)
    m = s * b * n
    block_m, warps = ROPE_CONFIG["block_m"], ROPE_CONFIG["num_warps"]
    _rope_kernel[(triton.cdiv(m, block_m),)](
        t, cos, sin, out, m, b, n, t.stride(0), t.stride(1), t.stride(2), d, rot, rot // 2,
        INTERLEAVED=bool(interleaved), BACKWARD=backward,
        BLOCK_M=block_m, BLOCK_H=triton.next_power_of_2(rot // 2),
        BLOCK_P=triton.next_power_of_2(d - rot) if d > rot else 0, num_warps=warps)
    return out


class RotaryFunction(torch.autograd.Function):
    """``t * cos(freqs) + rotate_half(t) * sin(freqs)`` on the first ``rot`` channels; saves only the ``[s, rot]``
    cosines and sines (no activation)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
        f = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
        cos, sin = f.cos().contiguous(), f.sin().contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rope(t, cos, sin, interleaved, False)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rope(dout, cos, sin, ctx.interleaved, True), None, None
