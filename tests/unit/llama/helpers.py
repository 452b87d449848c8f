"""Small Llama-family configurations shared by the model, parallel and checkpoint tests."""

import dataclasses

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.init import initialize_model_parameters
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig

VOCAB, PADDED_VOCAB = 100, 128


def llama_config(**kw) -> TransformerConfig:
    """Llama-3-shaped: GQA (4 heads, 2 groups), RoPE θ 500000 with Llama 3.1 scaling, RMSNorm, SwiGLU, no biases,
    untied output layer; dropout 0."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                seq_length=16, max_position_embeddings=16, padded_vocab_size=PADDED_VOCAB, attention_dropout=0.0,
                hidden_dropout=0.0, normalization="RMSNorm", layernorm_epsilon=1e-5, position_embedding_type="rope",
                rotary_base=500000, use_rope_scaling=True, gated_linear_unit=True, activation="silu",
                add_bias_linear=False, share_embeddings_and_output_weights=False)
    base.update(kw)
    return TransformerConfig(**base)


def with_options(config: TransformerConfig, **kw) -> TransformerConfig:
    return dataclasses.replace(config, **kw)


def built(config: TransformerConfig, pstate: ParallelState = None, seed: int = 7, **model_kw) -> GPTModel:
    pstate = pstate or ParallelState.single()
    model = GPTModel(config, pstate, **model_kw)
    initialize_model_parameters(model, seed, config, pstate, layer_offset=model_kw.get("layer_offset", 0))
    return model


def batch(b: int = 2, s: int = 12, seed: int = 0):
    """(ids, positions, labels) ``[b, s]`` each."""
    ids = torch.randint(0, VOCAB, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].contiguous(), torch.arange(s).expand(b, s), ids[:, 1:].contiguous()
