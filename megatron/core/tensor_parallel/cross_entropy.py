"""Cross-entropy over vocab-parallel logits, computed on the shards.

Each TP rank holds logits ``z[..., r V/tp : (r+1) V/tp]``. With ``m`` the global maximum over the vocabulary,
``S = sum_j exp(z_j - m)`` and ``t`` the target id, the loss is ``log S - (z_t - m)``. Only per-token scalars
cross the wire: one all-reduce (max) for ``m`` and one all-reduce (sum) of the stacked ``[target logit, S,
sum_j z_j]`` (the last only with label smoothing), each of ``s x b`` elements; the ``s x b x V`` logits are
never gathered.

Label smoothing follows ``torch.nn.functional.cross_entropy``: the target distribution is
``q = (1 - eps) onehot(t) + eps / V`` over the full (padded) vocabulary of size ``V``, so
``loss = (1 - eps) (log S - (z_t - m)) + eps (log S + m - mean_j z_j)``.

Memory: the forward turns one fp32 copy of the local logits into the softmax in place and saves only that (plus
per-token ``[s, b]`` tensors); the backward turns the saved softmax into the gradient in place. So the graph
holds one fp32 ``[s, b, V/tp]`` buffer, and the backward may run only once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.collectives import group_rank, group_size
from megatron.core.tensor_parallel.mappings import all_reduce_max, all_reduce_sum


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token loss from vocab shards. Backward: ``(softmax - q) * grad`` on the local shard."""

    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing):
        world, rank = group_size(group), group_rank(group)
        part = logits.shape[-1]
        vocab = part * world
        # One fp32 working buffer [s, b, V/tp]; it becomes the softmax and is the only large tensor saved.
        work = logits.to(torch.float32, copy=True)
        logits_max = all_reduce_max(work.amax(dim=-1), group)  # [s, b]
        work.sub_(logits_max.unsqueeze(-1))  # z - m

        start = rank * part
        outside = (target < start) | (target >= start + part)  # [s, b]
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = work.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [s, b], z_t - m
        target_logit = target_logit.masked_fill(outside, 0.0)

        stats = [target_logit]
        if label_smoothing > 0.0:
            stats.append(work.sum(dim=-1))  # sum_j (z_j - m), local part
        work.exp_()
        stats.append(work.sum(dim=-1))  # local sum of exp(z - m)
        stats = all_reduce_sum(torch.stack(stats), group)  # [2 or 3, s, b]
        target_logit, sum_exp = stats[0], stats[-1]
        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - target_logit  # [s, b]
        if label_smoothing > 0.0:
            mean_shifted = stats[1] / vocab  # mean_j (z_j - m)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum_exp - mean_shifted)

        work.div_(sum_exp.unsqueeze(-1))  # softmax of the local shard
        ctx.save_for_backward(work, local_target, outside)
        ctx.label_smoothing, ctx.vocab, ctx.input_dtype = label_smoothing, vocab, logits.dtype
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("vocab_parallel_cross_entropy: backward can run only once (its buffer is reused)")
        ctx.used = True
        grad, local_target, outside = ctx.saved_tensors  # grad holds the softmax [s, b, V/tp]
        eps = ctx.label_smoothing
        if eps > 0.0:
            grad.sub_(eps / ctx.vocab)
        on_shard = (~outside).to(grad.dtype)  # [s, b]
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-(1.0 - eps) * on_shard).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy ``[s, b]`` (fp32) of vocab-parallel ``logits [s, b, V/tp]`` against the global
    target ids ``target [s, b]``; ``group`` is the TP group (``None`` for a single process)."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"--label-smoothing must be in [0, 1), got {label_smoothing}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on [s, b]")
    return _VocabParallelCrossEntropy.apply(logits, target, group, float(label_smoothing))
