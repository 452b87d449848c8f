"""The transformer layer's MLP: h -> ffn (column-parallel) -> activation -> h (row-parallel)."""

from __future__ import annotations

import torch
import torch.nn as nn

from megatron.core import tensor_parallel
from megatron.core.fusions.mlp import bias_activation, bias_activation_linear
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.sharding import fc1_sharding
from megatron.core.transformer.config import TransformerConfig


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> activation -> h (row-parallel); the activation needs no communication.

    The activation is the GeLU, or with ``gated_linear_unit`` the SwiGLU: ``linear_fc1`` then produces
    ``2 * ffn`` features, ``[gate; up]`` for the whole model and ``[gate_r; up_r]`` on each TP rank (one GEMM,
    Megatron-Core's layout, declared by ``tensor_parallel.sharding.fc1_sharding``), and the activation is
    ``silu(gate) * up``.

    The activation (with ``linear_fc1``'s bias, returned unadded) is fused with ``linear_fc2``'s GEMM where that
    saves memory: under ``--recompute-granularity selective`` (module ``mlp_act``, decided for this layer by its
    config) the activation output is not kept for backward but recomputed from the first GEMM's output (which the
    activation's backward keeps anyway): with flash attention the attention core stores little, and the GeLU
    output is ``8sbh/t`` bytes per layer for one element-wise pass. Under FP8 the GeLU is computed inside the
    quantization of ``linear_fc2``'s input. ``linear_fc2`` then only reduces this rank's partial product.
    """

    def __init__(self, config: TransformerConfig, pstate: ParallelState):
        super().__init__()
        self.config = config
        gated = config.gated_linear_unit
        if gated and config.activation != "silu":
            raise ValueError(f"a gated linear unit needs the silu activation (SwiGLU), got {config.activation}")
        if not gated and config.activation != "gelu":
            raise ValueError(f"activation {config.activation} needs a gated linear unit (--swiglu)")
        self.activation = "swiglu" if gated else "gelu"
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size * (2 if gated else 1), config=config, pstate=pstate,
            bias=config.add_bias_linear, gather_output=False, skip_bias_add=True, output_sharding=fc1_sharding(gated),
        )
        self.linear_fc2 = tensor_parallel.RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, config=config, pstate=pstate, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True,
        )
        self.recompute_act = config.recomputes("mlp_act")
        # the GeLU's fusion switch (--no-bias-gelu-fusion) applies to the GeLU; the SwiGLU is fused with the kernels
        self.fused = config.use_fused_kernels and (config.bias_gelu_fusion or gated)

    def forward(self, hidden: torch.Tensor):
        """hidden ``[s(/tp under SP), b, h]`` -> (output ``[s(/tp), b, h]``, ``linear_fc2``'s bias or None)."""
        inter, inter_bias = self.linear_fc1(hidden)  # [s, b, ffn/tp] ([s, b, 2 ffn/tp] gated)
        fc2 = self.linear_fc2
        recompute = self.recompute_act and self.training
        if recompute or self.config.fp8 is not None:
            partial = bias_activation_linear(
                inter, inter_bias, fc2.weight, self.activation, use_fused=self.fused,
                gradient_accumulation_fusion=fc2.gradient_accumulation_fusion, fp8_format=self.config.fp8,
                fp8_margin=self.config.fp8_margin, recompute=recompute, fp8_sites=fc2.fp8_sites)
        else:
            partial = fc2.partial_product(bias_activation(inter, inter_bias, self.activation, self.fused))
        return fc2.reduce(partial)  # ([s(/tp), b, h], bias)
