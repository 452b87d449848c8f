"""Scoring evaluation samples with the model: summed target loss (WikiText) or whole-target accuracy (LAMBADA)."""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ParallelState


def vocab_parallel_argmax(logits: torch.Tensor, pstate: ParallelState) -> torch.Tensor:
    """Argmax over the whole vocabulary of vocab-parallel ``logits [b, s, V/tp]`` -> ids ``[b, s]`` (ties go to
    the lowest id, as ``torch.argmax`` on the gathered logits)."""
    values, ids = logits.float().max(dim=-1)  # [b, s]
    if pstate.tp_size == 1:
        return ids
    ids = ids + pstate.tp_rank * logits.shape[-1]
    all_values = [torch.empty_like(values) for _ in range(pstate.tp_size)]
    all_ids = [torch.empty_like(ids) for _ in range(pstate.tp_size)]
    dist.all_gather(all_values, values, group=pstate.tp_group)
    dist.all_gather(all_ids, ids, group=pstate.tp_group)
    best = torch.stack(all_values).argmax(dim=0, keepdim=True)  # [1, b, s]: first shard holding the maximum
    return torch.stack(all_ids).gather(0, best).squeeze(0)  # [b, s]


@torch.no_grad()
def score_samples(engine, samples: List[tuple], micro_batch_size: int, metric: str,
                  log: Optional[Callable[[str], None]] = None, log_interval: int = 0) -> float:
    """Sum over samples of the masked target loss (``metric="loss"``) or of 1 per sample whose every masked
    target is the argmax (``metric="accuracy"``). Collective over the model-parallel group of ``engine``
    (an ``InferenceEngine``); every rank returns the sum the last pipeline stage computed."""
    if metric not in ("loss", "accuracy"):
        raise ValueError(f"metric must be loss or accuracy, got {metric}")
    device, pstate = engine.device, engine.pstate
    engine.cache.release()  # full sequences, no KV cache
    total = 0.0
    batches = math.ceil(len(samples) / micro_batch_size)
    for n, start in enumerate(range(0, len(samples), micro_batch_size), 1):
        chunk = samples[start:start + micro_batch_size]
        tokens = torch.tensor([t for t, _ in chunk], dtype=torch.long, device=device)  # [b, s + 1]
        mask = torch.tensor([m for _, m in chunk], dtype=torch.float64, device=device)  # [b, s]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]  # [b, s] each
        out = engine.stage_forward(inputs, 0, labels=labels if metric == "loss" else None)
        if out is None:  # not the last pipeline stage
            pass
        elif metric == "loss":  # out: [b, s] vocab-parallel cross-entropy
            total += float((out.double() * mask).sum())
        else:  # out: [b, s, V/tp] logits
            correct = (vocab_parallel_argmax(out, pstate) == labels) | (mask == 0)  # [b, s]
            total += float(correct.all(dim=-1).sum())
        if log is not None and log_interval and n % log_interval == 0:
            log(f"> evaluated batch {n}/{batches}")
    return float(engine.from_last_stage(torch.tensor([total], dtype=torch.float64, device=device))[0])
