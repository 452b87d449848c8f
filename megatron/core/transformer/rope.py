"""Rotary position embedding: the rotation angles of each position, applied to queries and keys in attention.

Channel pairs ``(i, i + r/2)`` of the first ``r = kv_channels * rotary_percent`` channels of a head (or
``(2i, 2i + 1)`` with ``rotary_interleaved``) are rotated by ``position * inv_freq[i]``,
``inv_freq[i] = rotary_base ** (-2i / r)``; the remaining channels pass through. Positions are divided by
``rotary_seq_len_interpolation_factor`` when it is set; ``use_rope_scaling`` applies Llama 3.1's frequency scaling
(factor ``rope_scaling_factor``, low/high frequency factors 1 and 4, 8192 original positions), as Megatron-Core
and Hugging Face's ``rope_type="llama3"`` do.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from megatron.core.parallel_state import default_device
from megatron.core.transformer.config import TransformerConfig

LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's long-context scaling: long wavelengths divided by ``factor``, short ones kept, the band between
    interpolated smoothly."""
    low_wavelen = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (LLAMA3_ORIGINAL_MAX_POSITIONS / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """``forward(positions [s]) -> freqs [s, 1, 1, rot_dim]``: float32 angles, in the channel order the rotation
    expects (``[θ_0 .. θ_{r/2-1}, θ_0 .. θ_{r/2-1}]``, or each angle twice in a row when interleaved)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.rot_dim = int(config.kv_channels * config.rotary_percent)
        if self.rot_dim < 2 or self.rot_dim % 2:
            raise ValueError(f"--rotary-percent {config.rotary_percent} of --kv-channels {config.kv_channels} "
                             f"rotates {self.rot_dim} channels; it must be an even number of at least 2")
        self.interleaved = config.rotary_interleaved
        self.interpolation = config.rotary_seq_len_interpolation_factor
        exponent = torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device=default_device()) / self.rot_dim
        inv_freq = 1.0 / (float(config.rotary_base) ** exponent)  # [r/2]
        if config.use_rope_scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, config.rope_scaling_factor)
        # a plain attribute, not a buffer: it stays float32 when the model's parameters are cast
        self.inv_freq = inv_freq

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        pos = positions.to(torch.float32)
        if self.interpolation is not None:
            pos = pos / self.interpolation
        angles = torch.outer(pos, self.inv_freq)  # [s, r/2]
        if self.interleaved:
            emb = angles.repeat_interleave(2, dim=-1)  # [s, r]: θ_0 θ_0 θ_1 θ_1 ...
        else:
            emb = torch.cat((angles, angles), dim=-1)  # [s, r]
        return emb[:, None, None, :]  # [s, 1, 1, r]

    def positions(self, seq_length: int, position_ids: Optional[torch.Tensor], device) -> torch.Tensor:
        """The rotated positions of a forward over ``seq_length`` tokens: consecutive from the first sequence's
        first position id (0 in training; the cache offset when decoding), or from 0 without position ids."""
        steps = torch.arange(seq_length, device=device)
        if position_ids is None:
            return steps
        return position_ids[0, :1] + steps
