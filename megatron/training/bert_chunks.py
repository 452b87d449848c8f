"""This rank's BERT chunks (one per virtual pipeline stage), for pretraining and fine-tuning alike."""

from __future__ import annotations

from typing import Callable, List

import torch

from megatron.core.models.bert import initialize_bert_parameters
from megatron.core.pipeline_parallel.partition import stage_chunks
from megatron.training.config import TrainingContext, transformer_config


def build_bert_chunks(ctx: TrainingContext, post_ln: bool, make_chunk: Callable) -> List[torch.nn.Module]:
    """``make_chunk(config, chunk)`` for every chunk of this rank (``config``: the bidirectional encoder's
    ``TransformerConfig``, post-LN when ``post_ln``; ``chunk``: its stage's ``pre_process``, ``post_process``,
    ``num_layers`` and ``layer_offset``), each initialised layout-independently from ``--seed``."""
    m, par, pstate = ctx.config.model, ctx.config.parallel, ctx.pstate
    config = transformer_config(m, ctx.config.precision, par.sequence_parallel, ctx.padded_vocab_size,
                                attention_mask_type="padding", apply_residual_connection_post_layernorm=post_ln)
    chunks = []
    for c in stage_chunks(m.num_layers, pstate, par.decoder_first_pipeline_num_layers,
                          par.decoder_last_pipeline_num_layers):
        model = make_chunk(config, c)
        initialize_bert_parameters(model, ctx.config.training.seed, config, pstate, layer_offset=c.layer_offset)
        chunks.append(model)
    return chunks
