"""Plain PyTorch RMSNorm, rotary embedding and SwiGLU (replaced by the fused kernels' module on merge)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False,
             use_fused: bool = True) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    return (y * w).to(x.dtype)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                         use_fused: bool = True) -> torch.Tensor:
    rot = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    if interleaved:
        x1, x2 = t_rot[..., 0::2], t_rot[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = t_rot.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((t_rot * cos + rotated * sin, t_pass), dim=-1)


def swiglu(x: torch.Tensor, use_fused: bool = True) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
