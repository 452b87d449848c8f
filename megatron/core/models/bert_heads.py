"""BERT fine-tuning models: the pre-trained encoder with a sequence-classification or a multiple-choice head.

Both are ``BertModel`` chunks without the pre-training heads (``add_lm_head=False``, no binary head) and with two
token types (segment A and B of a pair). On the last pipeline stage they add, as Megatron-LM's fine-tuning models:

- ``pooler.dense`` (tanh of a dense layer on the first token, [CLS]) - the pre-trained pooler when the checkpoint
  has one;
- dropout (``--hidden-dropout``);
- ``classification_head`` (h -> number of classes) or ``multichoice_head`` (h -> 1: one score per choice).

A multiple-choice microbatch is ``[b, choices, s]``: every choice is its own sequence (the four are folded into the
batch dimension for the encoder) and the scores come back as ``[b, choices]`` logits, softmax over the choices.
The heads are small and replicated: every tensor-parallel rank computes them whole on the (whole) [CLS] hidden state.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megatron.core.models.bert import BertModel, Pooler
from megatron.core.parallel_state import ParallelState, default_device
from megatron.core.transformer.config import TransformerConfig

# the fine-tuning heads' parameter names (what a pre-trained checkpoint does not hold)
CLASSIFICATION_HEAD = "classification_head"
MULTICHOICE_HEAD = "multichoice_head"
# the pre-training heads a pre-trained checkpoint may hold and a fine-tuning model leaves out
PRETRAINING_HEADS = ("lm_head.", "output_layer.", "binary_head.")


class BertFinetuneModel(BertModel):
    """One pipeline chunk of a BERT with a fine-tuning head: ``num_classes`` logits per sequence
    (``multiple_choice=False``) or one score per choice (``multiple_choice=True``, ``num_classes`` ignored)."""

    def __init__(self, config: TransformerConfig, pstate: ParallelState, num_classes: int = 2,
                 multiple_choice: bool = False, pre_process: bool = True, post_process: bool = True,
                 num_layers: Optional[int] = None, layer_offset: int = 0, use_torch_compile: bool = False):
        super().__init__(config, pstate, pre_process=pre_process, post_process=post_process, num_layers=num_layers,
                         layer_offset=layer_offset, num_tokentypes=2, add_binary_head=False,
                         use_torch_compile=use_torch_compile, add_lm_head=False)
        if not multiple_choice and num_classes < 2:
            raise ValueError(f"a classifier needs at least 2 classes, got {num_classes}")
        self.multiple_choice = multiple_choice
        self.num_classes = 1 if multiple_choice else num_classes
        if post_process:
            self.pooler = Pooler(config, pstate)
            self.head_dropout = nn.Dropout(config.hidden_dropout)
            head = nn.Linear(config.hidden_size, self.num_classes, device=default_device(), dtype=config.params_dtype)
            setattr(self, MULTICHOICE_HEAD if multiple_choice else CLASSIFICATION_HEAD, head)

    @property
    def head(self) -> nn.Linear:
        return getattr(self, MULTICHOICE_HEAD if self.multiple_choice else CLASSIFICATION_HEAD)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``input_ids``, ``attention_mask`` (1 = token, 0 = padding), ``tokentype_ids``: ``[b, s]``, or
        ``[b, choices, s]`` for multiple choice. Returns the encoder output ``[s(/tp), b(*choices), h]`` on a stage
        without ``post_process``, else the logits: ``[b, num_classes]`` or ``[b, choices]``."""
        choices = None
        if self.multiple_choice:
            if attention_mask.dim() != 3:
                raise ValueError(f"a multiple-choice batch is [batch, choices, seq], got {tuple(attention_mask.shape)}")
            choices = attention_mask.shape[1]
            fold = lambda t: None if t is None else t.reshape(-1, t.shape[-1])  # noqa: E731  [b*c, s]
            input_ids, attention_mask, tokentype_ids = fold(input_ids), fold(attention_mask), fold(tokentype_ids)
        hidden = self.encode(input_ids, attention_mask, tokentype_ids)  # [s(/tp), b(*c), h]
        if not self.post_process:
            return hidden
        logits = self.head(self.head_dropout(self.pooler(hidden)))  # [b(*c), classes]
        if choices is not None:
            logits = logits.view(-1, choices)  # [b, c]
        return logits
