"""Hugging Face's ``BertForSequenceClassification`` fine-tuned with the recipe ``tasks/main.py`` runs: the
reference of ``bench/finetune_mnli.py`` and of the first-iteration loss test.

Same inputs: the token ids, token types and padding masks of the library's fine-tuning dataset (``[CLS] A [SEP] B
[SEP]`` as Megatron-LM builds them), visited in the same order (epoch ``e``: ``RandomState(seed + e)``'s
permutation, global batches in turn, the last incomplete one left out). Same start: the Hugging Face encoder and
pooler, and a classifier drawn as ``tasks/main.py`` draws it (N(0, init std) from the seed and its name, zero
bias). Same update: AdamW (weight decay on the >= 2-D weights only), gradient clipping, Megatron's learning-rate
schedule; the loss is the mean cross-entropy in fp32. Dropout is Hugging Face's own (its own random masks).
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def initial_classifier(seed: int, hidden: int, classes: int, init_std: float, name: str = "classification_head"):
    """``(weight, bias)`` of the head as ``tasks/main.py`` initialises it (layout-independent init by name)."""
    from megatron.core.models.init import initialize_model_parameters
    from megatron.core.parallel_state import ParallelState
    from megatron.core.transformer.config import TransformerConfig

    holder = torch.nn.Module()
    setattr(holder, name, torch.nn.Linear(hidden, classes))
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=hidden,
                               seq_length=8, max_position_embeddings=8, padded_vocab_size=8, init_method_std=init_std)
    initialize_model_parameters(holder, seed, config, ParallelState.build(1, 1), stack="encoder")
    head = getattr(holder, name)
    return head.weight.detach().clone(), head.bias.detach().clone()


def hf_classifier(model_dir: str, classes: int, seed: int, init_std: float = 0.02, dropout: float = 0.1):
    """The Hugging Face BERT of ``model_dir`` (``BertModel`` weights) with a ``classes``-way classifier."""
    import transformers

    model = transformers.BertForSequenceClassification.from_pretrained(
        model_dir, num_labels=classes, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        attn_implementation="eager")
    w, b = initial_classifier(seed, model.config.hidden_size, classes, init_std)
    with torch.no_grad():
        model.classifier.weight.copy_(w)
        model.classifier.bias.copy_(b)
    return model


def hf_multiple_choice(model_dir: str, seed: int, init_std: float = 0.02, dropout: float = 0.1):
    """The Hugging Face BERT of ``model_dir`` as ``BertForMultipleChoice`` (one logit per option), its scorer drawn
    as ``tasks/main.py --task RACE`` draws its ``multichoice_head``."""
    import transformers

    model = transformers.BertForMultipleChoice.from_pretrained(
        model_dir, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, attn_implementation="eager")
    w, b = initial_classifier(seed, model.config.hidden_size, 1, init_std, name="multichoice_head")
    with torch.no_grad():
        model.classifier.weight.copy_(w)
        model.classifier.bias.copy_(b)
    return model


def _inputs(dataset, idx, device) -> dict:
    batch = dataset.batch(idx)
    return ({"input_ids": torch.from_numpy(batch["text"]).to(device),
             "token_type_ids": torch.from_numpy(batch["types"]).to(device),
             "attention_mask": torch.from_numpy(batch["padding_mask"]).to(device)},
            torch.from_numpy(batch["label"]).to(device))


def hf_train(model, dataset, seed: int, epochs: int, global_batch: int, lr: float, warmup_fraction: float,
             weight_decay: float, clip_grad: float = 1.0, min_lr: float = 0.0, micro_batch: Optional[int] = None,
             log=None, max_iters: Optional[int] = None, autocast: Optional[torch.dtype] = None) -> List[float]:
    """Fine-tune ``model`` in place (on the device its parameters are on; under ``torch.autocast`` to ``autocast``
    when given, as Hugging Face's Trainer runs ``bf16=True``); returns the loss of every iteration."""
    from megatron.training.scheduler import OptimizerParamScheduler

    device = next(model.parameters()).device

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() > 1], "wd_mult": 1.0},
              {"params": [p for p in params if p.dim() <= 1], "wd_mult": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, foreach=False)
    per_epoch = len(dataset) // global_batch
    iters = epochs * per_epoch if max_iters is None else min(max_iters, epochs * per_epoch)
    sched = OptimizerParamScheduler(opt, lr, min_lr, int(warmup_fraction * epochs * per_epoch), epochs * per_epoch,
                                    "linear", weight_decay)
    micro = micro_batch or global_batch
    model.train()
    losses = []
    for it in range(iters):
        epoch, i = divmod(it, per_epoch)
        order = np.random.RandomState(seed + epoch).permutation(len(dataset))
        idx = order[i * global_batch:(i + 1) * global_batch]
        opt.zero_grad()
        total = 0.0
        for m in range(0, global_batch, micro):
            inputs, labels = _inputs(dataset, idx[m:m + micro], device)
            with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                logits = model(**inputs).logits
            loss = F.cross_entropy(logits.float(), labels) * (len(labels) / global_batch)
            loss.backward()
            total += loss.item()
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, clip_grad)
        opt.step()
        sched.step()
        losses.append(total)
        if log is not None:
            log(it + 1, iters, total)
    return losses


@torch.no_grad()
def hf_predict(model, dataset, batch: int = 64) -> np.ndarray:
    """The argmax class of every example."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(dataset), batch):
        inputs, _ = _inputs(dataset, np.arange(start, min(len(dataset), start + batch)), device)
        out.append(model(**inputs).logits.argmax(dim=-1).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def accuracy(pred: np.ndarray, labels: np.ndarray) -> Tuple[int, int, float]:
    correct = int((pred == labels).sum())
    return correct, len(labels), 100.0 * correct / max(1, len(labels))
