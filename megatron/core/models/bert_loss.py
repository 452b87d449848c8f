"""BERT's batch, forward step and loss: the masked-LM loss over ``loss_mask`` plus the binary-head loss.

The loss of one microbatch is ``lm + binary`` with

    lm     = sum(per-token MLM loss * loss_mask) / sum(loss_mask)
    binary = cross-entropy(binary logits, is_random), samples with label -1 ignored

and both parts are reported separately, as ``lm loss`` and ``sop loss`` (``nsp loss`` when the binary head
predicts the next sentence instead of the order); without the binary head the loss is the MLM loss alone.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.parallel_state import ParallelState, default_device

# the fields of a BERT sample that training reads (Megatron's names)
BERT_BATCH_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")


def bert_loss_func(loss_mask: torch.Tensor, sentence_order: Optional[torch.Tensor], output_tensor,
                   binary_loss_name: str = "sop loss") -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, {"lm loss": ..., binary_loss_name: ...})`` of one microbatch from the model's
    ``(per-token loss [b, s], binary_logits [b, 2] or None)``; ``loss_mask`` ``[b, s]``, ``sentence_order`` ``[b]``."""
    lm_losses, binary_logits = output_tensor
    mask = loss_mask.float().reshape(-1)
    lm_loss = torch.sum(lm_losses.float().reshape(-1) * mask) / mask.sum().clamp(min=1.0)
    if binary_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach()}
    if sentence_order is None:
        raise ValueError("the binary head needs the is_random labels of the batch")
    binary_loss = F.cross_entropy(binary_logits.float().view(-1, 2), sentence_order.reshape(-1), ignore_index=-1)
    return lm_loss + binary_loss, {"lm loss": lm_loss.detach(), binary_loss_name: binary_loss.detach()}


def max_masked_positions(mask_prob: float, seq_length: int) -> int:
    """The most positions the masked-LM datasets mask in one sample of ``seq_length`` tokens: the masking budget
    is at most ``mask_prob * target_length`` (``datasets/masking.py``) with ``target_length <= seq_length``, so
    ``floor(mask_prob * seq_length)`` bounds every sample (at least 1). The model projects this many positions per
    sample onto the vocabulary, whatever the sample."""
    return max(1, min(seq_length, math.floor(mask_prob * seq_length)))


def _check_masked_count(loss_mask: torch.Tensor, limit: Optional[int]) -> None:
    """A host-side check of a loader batch (no device read): no sample masks more than ``limit`` positions."""
    if limit is None or loss_mask.is_cuda:
        return
    most = int((loss_mask != 0).sum(dim=-1).max()) if loss_mask.numel() else 0
    if most > limit:
        raise ValueError(f"a BERT sample masks {most} positions, more than the {limit} the model projects per sample "
                         "(floor(--mask-prob x --seq-length)); the data was masked with a larger --mask-prob")


def get_bert_batch(data_iterator, pstate: ParallelState, max_masked: Optional[int] = None,
                   capturable: bool = False) -> Dict[str, Optional[torch.Tensor]]:
    """The next batch's fields (``BERT_BATCH_KEYS``, int64 ``[b, s]``, ``is_random`` ``[b]``) on every rank of the
    TP group: TP rank 0 reads the iterator, the others receive. Every pipeline stage calls it (every stage's
    attention needs the padding mask).

    ``attention_mask`` is added: the ``padding_mask`` to pass to the model, or None when the batch has no padding.
    That is decided on the host from the loader's CPU tensors, never by reading the device; with ``capturable``
    (the step is captured in a CUDA graph, whose later batches may be padded) or device-resident input it is
    always the mask. ``max_masked``: the model's positions per sample; a CPU batch that masks more is an error.
    """
    data, no_padding = None, False
    if pstate.tp_rank == 0:
        sample = next(data_iterator)
        missing = [k for k in BERT_BATCH_KEYS if k not in sample]
        if missing:
            raise ValueError(f"a BERT batch needs the fields {', '.join(BERT_BATCH_KEYS)}; missing "
                             f"{', '.join(missing)} (is the data a BERT masked-LM dataset?)")
        data = {k: torch.as_tensor(sample[k]).long() for k in BERT_BATCH_KEYS}
        _check_masked_count(data["loss_mask"], max_masked)
        padding = data["padding_mask"]
        no_padding = not capturable and not padding.is_cuda and not bool((padding < 1).any())
    if pstate.tp_size > 1 and not capturable:  # the TP group follows rank 0's choice, part of the broadcast
        if pstate.tp_rank == 0:
            data["no_padding"] = torch.tensor([int(no_padding)])
        batch = tensor_parallel.broadcast_data([*BERT_BATCH_KEYS, "no_padding"], data, torch.int64, pstate)
        no_padding = bool(batch.pop("no_padding").item())  # the broadcast already read its header on the host
    else:
        batch = tensor_parallel.broadcast_data(list(BERT_BATCH_KEYS), data, torch.int64, pstate)
    out = {k: v.to(default_device(), non_blocking=True) for k, v in batch.items()}
    out["attention_mask"] = None if no_padding else out["padding_mask"]
    return out


def make_bert_forward_step(pstate: ParallelState, binary_loss_name: str = "sop loss",
                           max_masked: Optional[int] = None, capturable: bool = False):
    """A ``forward_step_func(data_iterator, model) -> (output, loss_func)`` for the pipeline schedules.

    ``max_masked``: positions per sample projected onto the vocabulary (``max_masked_positions`` of the run's
    masking); None projects every position. ``capturable``: see ``get_bert_batch``.
    """

    def forward_step(data_iterator, model):
        inner = getattr(model, "module", model)
        batch = get_bert_batch(data_iterator, pstate, max_masked, capturable)
        post = inner.post_process
        output = model(batch["text"], batch["attention_mask"], tokentype_ids=batch["types"],
                       lm_labels=batch["labels"] if post else None, lm_loss_mask=batch["loss_mask"] if post else None,
                       max_masked_positions=max_masked if max_masked is not None else batch["text"].shape[1])
        return output, partial(bert_loss_func, batch["loss_mask"], batch["is_random"],
                               binary_loss_name=binary_loss_name)

    return forward_step
