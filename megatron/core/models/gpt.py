"""GPT: embeddings -> pre-norm decoder -> (tied) vocab-parallel output layer -> vocab-parallel cross-entropy.

The same model holds the Llama family: rotary instead of learned position embeddings
(``position_embedding_type``), RMSNorm, SwiGLU, grouped-query attention, no biases, an untied output layer.

Parameter names follow Megatron-Core's GPT so checkpoints interoperate:
``embedding.word_embeddings.weight``, ``embedding.position_embeddings.weight`` (learned absolute positions only),
``decoder.layers.N.{input_layernorm,self_attention.linear_qkv,self_attention.{q,k}_layernorm,
self_attention.linear_proj,pre_mlp_layernorm,mlp.linear_fc1,mlp.linear_fc2}.*``, ``decoder.final_layernorm.*`` and
``output_layer.weight`` (present when the output weight is untied, or tied but living on a later pipeline stage
than the embedding).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.fusions.linear import linear_with_grad_accumulation_fusion
from megatron.core.parallel_state import ParallelState, default_device
from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.rope import RotaryEmbedding


class LanguageModelEmbedding(nn.Module):
    """Word (vocab-parallel) + learned absolute position embeddings (``position_embedding_type ==
    "learned_absolute"``; none otherwise), then dropout; output ``[s(/tp), b, h]``."""

    def __init__(self, config: TransformerConfig, pstate: ParallelState):
        super().__init__()
        self.config, self.pstate = config, pstate
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, config=config, pstate=pstate
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    device=default_device(), dtype=config.params_dtype)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        # looked up in [s, b] order, so the sum is [s, b, h] as it is made (no transposing copy of the activations,
        # forward or backward)
        emb = self.word_embeddings(input_ids.t())  # [s, b, h]
        if self.position_embeddings is not None:
            emb = emb + self.position_embeddings(position_ids.t())  # [s, b, h]
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb, self.pstate.tp_group)  # [s/tp, b, h]
            with tensor_parallel.get_rng_tracker().fork():
                return self.dropout(emb)
        return self.dropout(emb)


class GPTModel(nn.Module):
    """One pipeline chunk of a GPT: ``pre_process`` holds the embedding, ``post_process`` the output and loss."""

    def __init__(
        self,
        config: TransformerConfig,
        pstate: ParallelState,
        pre_process: bool = True,
        post_process: bool = True,
        num_layers: Optional[int] = None,
        layer_offset: int = 0,
        use_torch_compile: bool = False,
        fused_cross_entropy: bool = False,
    ):
        super().__init__()
        if config.padded_vocab_size % pstate.tp_size != 0:
            raise ValueError(
                f"padded vocabulary {config.padded_vocab_size} is not divisible by --tensor-model-parallel-size "
                f"{pstate.tp_size}"
            )
        if use_torch_compile and config.fp8 is not None:
            raise ValueError("--fp8-format does not combine with --use-torch-compile")
        self.config, self.pstate = config, pstate
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.fused_cross_entropy = fused_cross_entropy
        self.input_tensor: Optional[torch.Tensor] = None
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, pstate)
        self.rotary_pos_emb = RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        n = config.num_layers if num_layers is None else num_layers
        self.decoder = TransformerBlock(config, pstate, n, post_layer_norm=post_process,
                                        use_torch_compile=use_torch_compile)
        self.output_layer = None
        if post_process and not (pre_process and config.share_embeddings_and_output_weights):
            w = torch.empty(config.padded_vocab_size // pstate.tp_size, config.hidden_size,
                            device=default_device(), dtype=config.params_dtype)
            self.output_layer = nn.Module()
            self.output_layer.weight = nn.Parameter(w)
            tensor_parallel.set_tensor_model_parallel_attributes(self.output_layer.weight, True, 0, 1)
            if config.share_embeddings_and_output_weights:
                self.output_layer.weight.shared_embedding = True
        if pre_process and config.share_embeddings_and_output_weights and pstate.pp_size > 1:
            self.embedding.word_embeddings.weight.shared_embedding = True

    # ---- pipeline plumbing -----------------------------------------------------------------------------
    def set_input_tensor(self, input_tensor) -> None:
        """Feed the activations received from the previous pipeline stage (ignored on the first stage)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                inference_context=None):
        """``input_ids``, ``position_ids`` ``[b, s]`` -> vocab-parallel logits ``[b, s, V/tp]`` (last stage; per-token
        losses ``[b, s]`` given ``labels``) or the activations ``[s(/tp), b, h]`` for the next stage.
        ``inference_context``: the key/value cache of incremental decoding (``inference.kv_cache.KVCache``); the
        tokens then sit at the positions ``position_ids`` after the cached ones."""
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)  # [s(/tp), b, h]
        else:
            if self.input_tensor is None:
                raise RuntimeError("a non-first pipeline stage needs set_input_tensor() before forward")
            hidden = self.input_tensor
        rotary = None
        if self.rotary_pos_emb is not None:
            seq = hidden.shape[0] * (self.pstate.tp_size if self.config.sequence_parallel else 1)
            rotary = self.rotary_pos_emb(self.rotary_pos_emb.positions(seq, position_ids, hidden.device))
        hidden = self.decoder(hidden, rotary_pos_emb=rotary, inference_context=inference_context)
        if not self.post_process:
            return hidden
        return self._output(hidden, labels)

    def _output(self, hidden: torch.Tensor, labels: Optional[torch.Tensor]):
        tp_group = self.pstate.tp_group
        if self.config.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tp_group)  # [s, b, h]
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, tp_group)
        weight = self.output_weight()
        if labels is None:
            logits = F.linear(hidden, weight)  # [s, b, V/tp]
            return logits.transpose(0, 1).contiguous()  # [b, s, V/tp]
        target = labels.transpose(0, 1)  # [s, b]
        if self.config.gradient_accumulation_fusion:
            logits = linear_with_grad_accumulation_fusion(hidden, weight)  # [s, b, V/tp]
        else:
            logits = F.linear(hidden, weight)  # [s, b, V/tp]
        if self.fused_cross_entropy and self.pstate.tp_size == 1 and logits.is_cuda:
            from megatron.core.fusions import fused_vocab_cross_entropy

            loss = fused_vocab_cross_entropy(logits, target)  # [s, b], no fp32 copy of the logits
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, tp_group)  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]
