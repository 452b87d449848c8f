"""BERT: word + position + token-type embeddings -> bidirectional encoder -> masked-LM head and binary head.

The encoder is the GPT's transformer block (same layer, fused kernels, FP8 path and recomputation) with
``config.attention_mask_type == "padding"``: attention is bidirectional and padded keys are masked out.
Pre-LN by default; ``config.apply_residual_connection_post_layernorm`` gives the original post-LN BERT (the first
layer's ``input_layernorm`` is then the embedding LayerNorm and each LayerNorm output feeds the residual branch;
docs/bert.md derives the correspondence).

Parameter names follow Megatron-Core's ``BertModel`` so that checkpoints convert both ways:
``embedding.{word,position,tokentype}_embeddings.weight``, ``encoder.layers.N.*`` (the GPT layer names),
``encoder.final_layernorm.*``, ``lm_head.dense.*``, ``lm_head.layer_norm.*``, ``output_layer.bias`` (plus
``output_layer.weight`` when untied, or tied but on a later pipeline stage than the embedding), ``pooler.dense.*``
and ``binary_head.*``.
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
from megatron.core.transformer.layer import LayerNorm
from megatron.core.models.init import global_parameter_name, initialize_model_parameters


def _linear(config: TransformerConfig, n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, device=default_device(), dtype=config.params_dtype)


class BertEmbedding(nn.Module):
    """Word (vocab-parallel) + learned position + token-type embeddings, then dropout; output ``[s(/tp), b, h]``."""

    def __init__(self, config: TransformerConfig, pstate: ParallelState, num_tokentypes: int):
        super().__init__()
        self.config, self.pstate = config, pstate
        dev, dt = default_device(), config.params_dtype
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, config=config, pstate=pstate
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                device=dev, dtype=dt)
        self.tokentype_embeddings = (nn.Embedding(num_tokentypes, config.hidden_size, device=dev, dtype=dt)
                                     if num_tokentypes > 0 else None)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        emb = self.word_embeddings(input_ids.t()) + self.position_embeddings(position_ids.t())  # [s, b, h]
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                tokentype_ids = torch.zeros_like(input_ids)  # every token in segment A
            emb = emb + self.tokentype_embeddings(tokentype_ids.t())  # [s, b, h]
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb, self.pstate.tp_group)  # [s/tp, b, h]
            with tensor_parallel.get_rng_tracker().fork():
                return self.dropout(emb)
        return self.dropout(emb)


class BertLMHead(nn.Module):
    """dense (h -> h), GeLU, LayerNorm; the decoder (tied output GEMM and vocabulary bias) is the model's.

    Runs on this rank's sequence slice under sequence parallelism, so its grads are partial sums there
    (``sequence_parallel`` marks them for the TP all-reduce, like the LayerNorms of the layers).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.dense = _linear(config, config.hidden_size, config.hidden_size)
        for p in self.dense.parameters():
            p.sequence_parallel = config.sequence_parallel
        self.layer_norm = LayerNorm(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden)))  # [s(/tp), b, h]


class Pooler(nn.Module):
    """tanh(dense(hidden of the first token)); the same on every TP rank (the full sequence is gathered under SP)."""

    def __init__(self, config: TransformerConfig, pstate: ParallelState):
        super().__init__()
        self.dense = _linear(config, config.hidden_size, config.hidden_size)
        self.sequence_parallel, self.tp_group = config.sequence_parallel, pstate.tp_group

    def forward(self, hidden: torch.Tensor, index: int = 0) -> torch.Tensor:
        if self.sequence_parallel:
            # every rank computes the pooler on the whole sequence: its gradient is complete, so backward splits
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, self.tp_group, tensor_parallel_output_grad=False)  # [s, b, h]
        return torch.tanh(self.dense(hidden[index]))  # [b, h]


class BertModel(nn.Module):
    """One pipeline chunk of a BERT: ``pre_process`` holds the embedding, ``post_process`` the heads and loss.

    ``num_tokentypes`` is 2 with the binary head and 0 without it (as Megatron builds it); ``add_binary_head``
    adds the pooler and the 2-way NSP/SOP classifier; ``add_lm_head=False`` leaves the masked-LM head out (a
    fine-tuning model adds its own heads on ``encode()``'s output, ``bert_heads.py``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        pstate: ParallelState,
        pre_process: bool = True,
        post_process: bool = True,
        num_layers: Optional[int] = None,
        layer_offset: int = 0,
        num_tokentypes: int = 2,
        add_binary_head: bool = True,
        use_torch_compile: bool = False,
        add_lm_head: bool = True,
    ):
        super().__init__()
        if config.attention_mask_type != "padding":
            raise ValueError("BERT needs a bidirectional encoder: build its TransformerConfig with "
                             f"attention_mask_type='padding' (got '{config.attention_mask_type}')")
        if config.padded_vocab_size % pstate.tp_size != 0:
            raise ValueError(f"padded vocabulary {config.padded_vocab_size} is not divisible by "
                             f"--tensor-model-parallel-size {pstate.tp_size}")
        if config.attention_backend == "flash":
            raise ValueError("attention backend flash takes no padding mask, which BERT needs; "
                             "use --attention-backend sdpa, cudnn or unfused")
        if use_torch_compile and config.fp8 is not None:
            raise ValueError("--fp8-format does not combine with --use-torch-compile")
        self.config, self.pstate = config, pstate
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.add_binary_head = add_binary_head
        self.input_tensor: Optional[torch.Tensor] = None
        tied = config.share_embeddings_and_output_weights
        if pre_process:
            self.embedding = BertEmbedding(config, pstate, num_tokentypes)
        n = config.num_layers if num_layers is None else num_layers
        self.encoder = TransformerBlock(config, pstate, n, post_layer_norm=post_process,
                                        use_torch_compile=use_torch_compile)
        if post_process and add_lm_head:
            self.lm_head = BertLMHead(config)
            vocab_part = config.padded_vocab_size // pstate.tp_size
            dev, dt = default_device(), config.params_dtype
            self.output_layer = nn.Module()
            self.output_layer.bias = nn.Parameter(torch.empty(vocab_part, device=dev, dtype=dt))
            tensor_parallel.set_tensor_model_parallel_attributes(self.output_layer.bias, True, 0, 1)
            if not (pre_process and tied):
                w = torch.empty(vocab_part, config.hidden_size, device=dev, dtype=dt)
                self.output_layer.weight = nn.Parameter(w)
                tensor_parallel.set_tensor_model_parallel_attributes(self.output_layer.weight, True, 0, 1)
                if tied:
                    self.output_layer.weight.shared_embedding = True
        if post_process and add_binary_head:
            self.pooler = Pooler(config, pstate)
            self.binary_head = _linear(config, config.hidden_size, 2)
        if pre_process and tied and pstate.pp_size > 1 and add_lm_head:
            self.embedding.word_embeddings.weight.shared_embedding = True

    # ---- pipeline plumbing -----------------------------------------------------------------------------
    def set_input_tensor(self, input_tensor) -> None:
        """Feed the activations received from the previous pipeline stage (ignored on the first stage)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def output_weight(self) -> torch.Tensor:
        weight = getattr(self.output_layer, "weight", None)
        return weight if weight is not None else self.embedding.word_embeddings.weight

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                tokentype_ids: Optional[torch.Tensor] = None, lm_labels: Optional[torch.Tensor] = None,
                lm_loss_mask: Optional[torch.Tensor] = None, max_masked_positions: Optional[int] = None):
        """``input_ids``, ``tokentype_ids``, ``lm_labels`` ``[b, s]``; ``attention_mask`` ``[b, s]``, 1 for a token
        and 0 for padding (the dataset's ``padding_mask``), or None for a batch known to have no padding (attention
        then runs without a mask, and SDPA may pick its FlashAttention kernel). Every pipeline stage needs the
        same ``attention_mask``. The model never reads device values on the host, so its step can be captured
        in a CUDA graph: the caller decides whether to pass the mask (``bert_loss.get_bert_batch``).

        Returns the encoder output ``[s(/tp), b, h]`` on a stage without ``post_process``; otherwise
        ``(logits [b, s, V/tp], binary_logits [b, 2] or None)`` without labels and
        ``(per-token loss [b, s] fp32, binary_logits)`` with them (labels outside the vocabulary, e.g. -1 at
        unmasked positions, give a finite loss that the loss mask removes).

        ``lm_loss_mask`` ``[b, s]`` with ``max_masked_positions`` ``k`` (with ``lm_labels``): the vocabulary
        projection and the cross-entropy run on ``k`` positions per sample only, the masked ones first (the
        dataset masks at most ``k``: ``bert_loss.max_masked_positions``), and the per-token loss is 0 at every
        unmasked position. The loss over the masked positions is the same; the largest GEMM and the fp32 softmax
        buffer shrink from ``s`` to ``k`` rows per sample, with shapes fixed by ``k`` alone.
        """
        hidden = self.encode(input_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return hidden
        binary_logits = self.binary_head(self.pooler(hidden)) if self.add_binary_head else None  # [b, 2]
        lm = self._lm_output(self.lm_head(hidden), lm_labels, lm_loss_mask, max_masked_positions)
        return lm, binary_logits

    def encode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
               tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Embedding (first stage) or the previous stage's activations, then this chunk's layers (and the final
        LayerNorm on the last stage): ``[s(/tp), b, h]``. Arguments as ``forward``."""
        padding = None
        if attention_mask is not None:
            b, s = attention_mask.shape
            padding = (attention_mask < 0.5).view(b, 1, 1, s)  # [b, 1, 1, s], True = masked out
        if self.pre_process:
            s = input_ids.shape[1]
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand_as(input_ids)  # [b, s]
            hidden = self.embedding(input_ids, position_ids, tokentype_ids)  # [s(/tp), b, h]
        else:
            if self.input_tensor is None:
                raise RuntimeError("a non-first pipeline stage needs set_input_tensor() before forward")
            hidden = self.input_tensor
        return self.encoder(hidden, padding)

    def _lm_output(self, hidden: torch.Tensor, labels: Optional[torch.Tensor],
                   loss_mask: Optional[torch.Tensor] = None, max_masked: Optional[int] = None) -> torch.Tensor:
        tp_group = self.pstate.tp_group
        if self.config.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tp_group)  # [s, b, h]
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, tp_group)
        weight, bias = self.output_weight(), self.output_layer.bias
        if labels is not None and loss_mask is not None:
            if max_masked is None:
                raise ValueError("the masked-LM loss over lm_loss_mask needs max_masked_positions (the dataset's "
                                 "bound on masked positions per sample, bert_loss.max_masked_positions)")
            if max_masked < hidden.shape[0]:
                return self._masked_lm_loss(hidden, weight, bias, labels, loss_mask, max_masked)
        if labels is not None and self.config.gradient_accumulation_fusion:
            logits = linear_with_grad_accumulation_fusion(hidden, weight, bias)  # [s, b, V/tp]
        else:
            logits = F.linear(hidden, weight, bias)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/tp]
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t(), tp_group)  # [s, b]
        if loss_mask is not None:  # every position projected (k >= s): still 0 where unmasked
            loss = torch.where(loss_mask.t() != 0, loss, 0.0)  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]

    def _masked_lm_loss(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        labels: torch.Tensor, loss_mask: torch.Tensor, k: int) -> torch.Tensor:
        """Per-token loss ``[b, s]`` from ``k`` selected positions per sample (0 at every unmasked position).

        A stable descending sort of ``loss_mask != 0`` puts each sample's masked positions first, in position
        order; its first ``k`` entries are the selection. Every shape depends on ``k`` only, nothing is read on the
        host, and slots beyond a sample's masked count (unmasked positions) get weight 0.
        """
        s, b, h = hidden.shape
        keep = loss_mask != 0  # [b, s]
        order = torch.sort(keep.to(torch.int8), dim=1, descending=True, stable=True).indices  # [b, s]
        order = order[:, :k].contiguous()  # [b, k] (a copy: the scatter's backward keeps k indices, not s)
        selected = keep.gather(1, order).t()  # [k, b], False in the unused slots
        rows = order.t() * b + torch.arange(b, device=order.device)  # [k, b] row of (position, sample) in s*b
        picked = hidden.reshape(s * b, h).index_select(0, rows.reshape(-1)).view(k, b, h)  # [k, b, h]
        if self.config.gradient_accumulation_fusion:
            logits = linear_with_grad_accumulation_fusion(picked, weight, bias)  # [k, b, V/tp]
        else:
            logits = F.linear(picked, weight, bias)  # [k, b, V/tp]
        target = labels.t().gather(0, order.t())  # [k, b]
        picked_loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, self.pstate.tp_group)  # [k, b]
        picked_loss = torch.where(selected, picked_loss, 0.0)  # [k, b]
        loss = picked_loss.new_zeros(b, s).scatter(1, order, picked_loss.t())  # [b, s]
        return loss


# --------------------------------------------------------------------------------------------------------------
# Layout-independent initialisation
# --------------------------------------------------------------------------------------------------------------
def global_bert_parameter_name(name: str, layer_offset: int, tied_output: bool) -> str:
    """A chunk-local parameter name as named in the whole model (the key of its initialisation seed)."""
    return global_parameter_name(name, layer_offset, tied_output, stack="encoder")


def initialize_bert_parameters(model: nn.Module, seed: int, config: TransformerConfig, pstate: ParallelState,
                               layer_offset: int = 0) -> None:
    """The GPT's layout-independent initialisation (``models/init.py``) over the encoder's parameter names."""
    initialize_model_parameters(model, seed, config, pstate, layer_offset, stack="encoder")
