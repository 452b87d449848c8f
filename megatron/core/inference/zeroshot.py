"""Zero-shot scoring of WikiText windows and LAMBADA passages: summed target loss or whole-target accuracy.

The same code serves ``tasks/main.py`` (a loaded checkpoint behind an ``InferenceEngine``) and the training
loop's ``--eval-tasks`` (the model being trained, in place, through ``ModelChunksForward``). Both give
``score_samples`` a *runner*: an object with ``device``, ``pstate``, ``vocab_size`` (the real vocabulary, or None),
``stage_forward(tokens, start, labels=)`` (a forward through the pipeline, ``pipeline_forward``; the last stage
returns vocab-parallel logits ``[b, s, V/tp]`` or, given labels, per-token losses ``[b, s]``; other stages return
``None``) and ``from_last_stage(t)`` (broadcast from the last pipeline stage).
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.inference.pipeline_forward import pipeline_forward
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


def real_vocab_logits(logits: torch.Tensor, vocab_size: Optional[int], pstate: ParallelState) -> torch.Tensor:
    """Vocab-parallel ``logits [b, s, V/tp]`` with the columns of the padding rows (ids >= ``vocab_size``) at -inf:
    scores over the real vocabulary, as sampling is (a converted model's padding rows are zeros, whose logits would
    otherwise take probability mass and win argmaxes)."""
    part = logits.shape[-1]
    start = pstate.tp_rank * part
    if vocab_size is None or start + part <= vocab_size:
        return logits
    padding = torch.arange(start, start + part, device=logits.device) >= vocab_size  # [V/tp]
    return logits.float().masked_fill(padding, float("-inf"))


@torch.no_grad()
def score_samples(runner, samples: List[tuple], micro_batch_size: int, metric: str,
                  log: Optional[Callable[[str], None]] = None, log_interval: int = 0) -> float:
    """Sum over samples of the masked target loss (``metric="loss"``) or of 1 per sample whose every masked
    target is the argmax (``metric="accuracy"``), over the runner's real vocabulary (``vocab_size``).

    Collective over the runner's model-parallel group and, when its ``pstate`` has data-parallel replicas, over
    those too: replica ``r`` scores samples ``r, r + dp, r + 2 dp, ...`` and the sums are added. Every rank
    returns the total over all samples.
    """
    if metric not in ("loss", "accuracy"):
        raise ValueError(f"metric must be loss or accuracy, got {metric}")
    device, pstate = runner.device, runner.pstate
    if pstate.dp_size > 1:
        samples = samples[pstate.dp_rank::pstate.dp_size]
    total = 0.0
    batches = math.ceil(len(samples) / micro_batch_size)
    for n, start in enumerate(range(0, len(samples), micro_batch_size), 1):
        chunk = samples[start:start + micro_batch_size]
        tokens = torch.tensor([t for t, _ in chunk], dtype=torch.long, device=device)  # [b, s + 1]
        mask = torch.tensor([m for _, m in chunk], dtype=torch.float64, device=device)  # [b, s]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]  # [b, s] each
        logits = runner.stage_forward(inputs, 0)  # [b, s, V/tp]; None off the last pipeline stage
        if logits is not None:
            logits = real_vocab_logits(logits, runner.vocab_size, pstate)
            if metric == "loss":
                losses = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, pstate.tp_group)  # [b, s]
                total += float((losses.double() * mask).sum())
            else:
                correct = (vocab_parallel_argmax(logits, pstate) == labels) | (mask == 0)  # [b, s]
                total += float(correct.all(dim=-1).sum())
        if log is not None and log_interval and n % log_interval == 0:
            log(f"> evaluated batch {n}/{batches}")
    result = runner.from_last_stage(torch.tensor([total], dtype=torch.float64, device=device))
    if pstate.dp_size > 1:
        dist.all_reduce(result, group=pstate.dp_group)
    return float(result[0])


def count_targets(samples: Sequence[tuple]) -> int:
    """Targets that count (mask 1) over ``samples``; for a whole WikiText file, its tokens minus one."""
    return sum(sum(mask) for _, mask in samples)


def wikitext_metrics(total_loss: float, num_targets: int, token_ratio: float) -> dict:
    """``avg loss`` per target, its perplexity and the word-level ``adjusted ppl`` = exp(loss x token ratio),
    both capped at exp(20) as Megatron-LM does."""
    loss = total_loss / max(num_targets, 1)
    return {"avg loss": loss, "ppl": math.exp(min(20.0, loss)), "adjusted ppl": math.exp(min(20.0, loss * token_ratio))}


class ModelChunksForward:
    """A ``score_samples`` runner over this rank's model chunks as the trainer holds them (data-parallel wrappers
    around ``GPTModel`` chunks, one per virtual pipeline stage), used in place: nothing is copied or changed.

    A batch goes through the trainer's own forward-only pipeline schedule (``pipeline_forward``), virtual stages
    and sequence parallelism included. The caller puts the chunks in eval mode.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], pstate: ParallelState, vocab_size: Optional[int] = None):
        """``vocab_size``: the tokenizer's vocabulary (scores leave the padding rows out); None: every row."""
        self.chunks = list(chunks)
        self.pstate = pstate
        self.vocab_size = vocab_size
        self.device = next(self.chunks[0].parameters()).device

    def stage_forward(self, tokens: torch.Tensor, start: int = 0, labels: Optional[torch.Tensor] = None):
        b, s = tokens.shape
        positions = torch.arange(start, start + s, device=self.device).unsqueeze(0).expand(b, s)  # [b, s]
        return pipeline_forward(self.chunks, self.pstate, tokens, positions, labels=labels)

    def from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        if self.pstate.pp_size > 1:
            dist.broadcast(t, src=self.pstate.pp_ranks[-1], group=self.pstate.pp_group)
        return t
