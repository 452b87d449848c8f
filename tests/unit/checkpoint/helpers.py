"""Build our GPT (any TP/PP stage) from checkpoint sizes and state dicts, for the checkpoint tests."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron.core.checkpoint_formats import ModelDims, merge_tp_pp, split_tp_pp
from megatron.core.models.gpt import GPTModel
from megatron.core.models.init import initialize_model_parameters
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.transformer.config import TransformerConfig

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_gpt")


def tiny_dims(vocab: int = 100, layers: int = 2, tied: bool = True, divisible_by: int = 8) -> ModelDims:
    from megatron.core.checkpoint_formats import pad_vocab_size

    return ModelDims(num_layers=layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     max_position_embeddings=16, padded_vocab_size=pad_vocab_size(vocab, divisible_by, 1),
                     vocab_size=vocab, make_vocab_size_divisible_by=divisible_by, seq_length=16,
                     layernorm_epsilon=1e-5, tied_embeddings=tied)


def config_for(dims: ModelDims, tp: int = 1, dtype=torch.float32) -> TransformerConfig:
    return TransformerConfig(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_attention_heads,
        ffn_hidden_size=dims.ffn_hidden_size, seq_length=dims.seq_length or dims.max_position_embeddings,
        max_position_embeddings=dims.max_position_embeddings, padded_vocab_size=dims.padded_for(tp),
        attention_dropout=0.0, hidden_dropout=0.0, layernorm_epsilon=dims.layernorm_epsilon,
        layernorm_zero_centered_gamma=dims.apply_layernorm_1p, params_dtype=dtype,
        share_embeddings_and_output_weights=dims.tied_embeddings, use_fused_kernels=False,
        gradient_accumulation_fusion=False)


def build_stage(dims: ModelDims, pstate: ParallelState, state=None, dtype=torch.float32, seed: int = 0) -> GPTModel:
    """This rank's model (no interleaving), randomly initialised or loaded strictly from ``state``."""
    offset, count = layers_for_stage(dims.num_layers, pstate.pp_size, pstate.pp_rank)
    model = GPTModel(config_for(dims, pstate.tp_size, dtype), pstate, pre_process=pstate.is_pipeline_first_stage,
                     post_process=pstate.is_pipeline_last_stage, num_layers=count, layer_offset=offset)
    if state is None:
        initialize_model_parameters(model, seed, model.config, pstate, layer_offset=offset)
    else:
        model.load_state_dict(state, strict=True)
    return model.eval()


def random_full(dims: ModelDims, seed: int = 0) -> dict:
    """A randomly initialised full state dict with zero vocabulary-padding rows."""
    model = build_stage(dims, ParallelState.single(), seed=seed)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in full:
            full[name][dims.vocab_size:] = 0.0
    for name, t in full.items():  # non-trivial norm parameters and biases
        if "layernorm" in name or name.endswith(".bias"):
            full[name] = t + 0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(len(name)))
    return full


def single_logits(full: dict, dims: ModelDims, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, V]`` of the unsharded model."""
    model = build_stage(dims, ParallelState.single(), full)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos)


def pipeline_logits(ranks: dict, dims: ModelDims, pp: int, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a TP=1 x PP=pp layout, running the stages one after another in this process."""
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    hidden = None
    for p in range(pp):
        pstate = ParallelState(pp_size=pp, pp_rank=p, pp_ranks=list(range(pp)))
        stage = build_stage(dims, pstate, ranks[(0, p)][0])
        stage.set_input_tensor(hidden)
        with torch.no_grad():
            hidden = stage(tokens, pos)
    return hidden


def tp_logits_body(rank, world_size, dims_dict, shards, tokens, out_path):
    """Run in ``world_size`` processes: TP=world_size forward, full-vocabulary logits saved by rank 0."""
    dims = ModelDims(**dims_dict)
    pstate = ParallelState.build(tensor_model_parallel_size=world_size)
    model = build_stage(dims, pstate, shards[(rank, 0)][0])
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        local = model(tokens, pos)  # [b, s, V/tp]
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous(), group=pstate.tp_group)
    if rank == 0:
        torch.save(torch.cat(parts, dim=-1), out_path)  # [b, s, V]


__all__ = ["FIXTURE", "build_stage", "config_for", "merge_tp_pp", "pipeline_logits", "random_full",
           "single_logits", "split_tp_pp", "tiny_dims", "tp_logits_body"]
