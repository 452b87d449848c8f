"""BERT's batch, forward step and loss: the masked-LM loss over ``loss_mask`` plus the binary-head loss.

The loss of one microbatch is ``lm + binary`` with

    lm     = sum(per-token MLM loss * loss_mask) / sum(loss_mask)
    binary = cross-entropy(binary logits, is_random), samples with label -1 ignored

and both parts are reported separately, as ``lm loss`` and ``sop loss`` (``nsp loss`` when the binary head
predicts the next sentence instead of the order); without the binary head the loss is the MLM loss alone.
"""

from __future__ import annotations

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


def get_bert_batch(data_iterator, pstate: ParallelState) -> Dict[str, torch.Tensor]:
    """The next batch's fields (``BERT_BATCH_KEYS``, int64 ``[b, s]``, ``is_random`` ``[b]``) on every rank of the
    TP group: TP rank 0 reads the iterator, the others receive. Every pipeline stage calls it (every stage's
    attention needs the padding mask)."""
    data = None
    if pstate.tp_rank == 0:
        sample = next(data_iterator)
        missing = [k for k in BERT_BATCH_KEYS if k not in sample]
        if missing:
            raise ValueError(f"a BERT batch needs the fields {', '.join(BERT_BATCH_KEYS)}; missing "
                             f"{', '.join(missing)} (is the data a BERT masked-LM dataset?)")
        data = {k: torch.as_tensor(sample[k]).long() for k in BERT_BATCH_KEYS}
    batch = tensor_parallel.broadcast_data(list(BERT_BATCH_KEYS), data, torch.int64, pstate)
    return {k: v.to(default_device(), non_blocking=True) for k, v in batch.items()}


def make_bert_forward_step(pstate: ParallelState, binary_loss_name: str = "sop loss"):
    """A ``forward_step_func(data_iterator, model) -> (output, loss_func)`` for the pipeline schedules."""

    def forward_step(data_iterator, model):
        inner = getattr(model, "module", model)
        batch = get_bert_batch(data_iterator, pstate)
        labels = batch["labels"] if inner.post_process else None
        output = model(batch["text"], batch["padding_mask"], tokentype_ids=batch["types"], lm_labels=labels,
                       lm_loss_mask=batch["loss_mask"] if inner.post_process else None)
        return output, partial(bert_loss_func, batch["loss_mask"], batch["is_random"],
                               binary_loss_name=binary_loss_name)

    return forward_step
