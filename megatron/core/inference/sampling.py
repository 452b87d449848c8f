"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature == 0`` or ``greedy`` means argmax; ``top_k == 0`` and ``top_p == 0`` are off.

    ``stop_strings`` end a sequence as soon as its generated text contains one (the text is cut before it);
    ``stop_on_eod`` ends it at the end-of-document token and ``stop_on_eol`` at the first generated newline.
    ``logprobs`` asks for the log-probability of every token after the first (prompt and generated).
    """

    max_new_tokens: int = 32
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: Optional[int] = None
    stop_on_eod: bool = True
    stop_on_eol: bool = False
    stop_strings: Tuple[str, ...] = field(default_factory=tuple)
    logprobs: bool = False
    top_logprobs: int = 0  # also record the this many most likely tokens at every generated position
    prompt_top_logprobs: bool = False  # and at every prompt position after the first (needs logprobs)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError("give top_k or top_p, not both")
        if self.prompt_top_logprobs and not (self.logprobs and self.top_logprobs):
            raise ValueError("prompt_top_logprobs needs logprobs and top_logprobs")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


def sample_next(logits: torch.Tensor, params: SamplingParams, vocab_size: int,
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """``logits [b, V_padded]`` -> token ids ``[b]``; ids at or above ``vocab_size`` (padding) are never chosen."""
    logits = logits.float()
    if vocab_size < logits.shape[-1]:
        logits = logits[:, :vocab_size]  # [b, V]
    if params.is_greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    elif 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [b, V]
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first token always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
