"""Layout-independent initialisation: every parameter is drawn whole, then sliced.

Each parameter's full (unsharded) tensor comes from a generator seeded by ``(seed, global name)``, where the
global name numbers layers across pipeline stages. Any TP/PP layout therefore starts from the same model.
"""

from __future__ import annotations

import math
import re
import zlib

import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig

def global_parameter_name(name: str, layer_offset: int, tied_output: bool, stack: str = "decoder") -> str:
    """Map a chunk-local parameter name to its name in the whole model (the key of its init seed); ``stack``: the
    layer stack's name, ``decoder`` (GPT) or ``encoder`` (BERT)."""
    name = re.sub(rf"^{stack}\.layers\.(\d+)\.", lambda m: f"{stack}.layers.{int(m.group(1)) + layer_offset}.", name)
    if tied_output and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"  # the tied copy on the last stage starts equal
    return name


def _init_full(name: str, shape, config: TransformerConfig, gen: torch.Generator, device) -> torch.Tensor:
    full = torch.empty(shape, dtype=torch.float32, device=device)
    leaf = name.rsplit(".", 1)[-1]
    if "layernorm" in name or "layer_norm" in name:  # q_layernorm / k_layernorm too  # BERT's LM head names its LayerNorm layer_norm
        fill = 0.0 if (leaf == "weight" and config.layernorm_zero_centered_gamma) else float(leaf == "weight")
        return full.fill_(fill)
    if leaf == "bias":
        return full.zero_()
    std = config.init_method_std
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * config.num_layers)  # scaled init of the residual-branch outputs
    return full.normal_(0.0, std, generator=gen)


@torch.no_grad()
def initialize_model_parameters(
    model: torch.nn.Module, seed: int, config: TransformerConfig, pstate: ParallelState, layer_offset: int = 0,
    stack: str = "decoder",
) -> None:
    """Draw every parameter whole from a generator seeded by ``(seed, global name)`` and keep this rank's slice:
    the same full model at any TP/PP layout. LayerNorms start at (1, 0), biases at 0, weights at
    N(0, init_method_std), the residual-branch output projections at N(0, std / sqrt(2 * num_layers))."""
    tied = config.share_embeddings_and_output_weights
    for name, param in model.named_parameters():
        gname = global_parameter_name(name, layer_offset, tied, stack)
        sharding = getattr(param, "tp_sharding", None)  # how the layer split it (tensor_parallel.TPSharding)
        shape = list(param.shape) if sharding is None else sharding.full_shape(param.shape, pstate.tp_size)
        gen = torch.Generator(device=param.device)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(gname.encode())) % (2**63 - 1))
        full = _init_full(gname, shape, config, gen, param.device)
        if sharding is not None:
            full = sharding.shard(full, pstate.tp_size, pstate.tp_rank, gname)
        param.copy_(full)
