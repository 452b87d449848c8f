"""The transformer layer's MLP: h -> ffn (column-parallel) -> GeLU -> h (row-parallel)."""

from __future__ import annotations

import torch
import torch.nn as nn

from megatron.core import tensor_parallel
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel); the GeLU needs no communication.

    The GeLU (with the first linear's bias, which ``linear_fc1`` returns unadded) is applied by ``linear_fc2``
    to its input, so it can be fused with that GEMM: under ``--recompute-granularity selective`` (module
    ``mlp_act``, decided for this layer by its config) the GeLU output is not kept for backward but recomputed
    from the first GEMM's output (which the GeLU backward keeps anyway): with flash attention the attention core
    stores little, and the GeLU output is ``8sbh/t`` bytes per layer for one element-wise pass. Under FP8 the
    GeLU is computed inside the quantization of ``linear_fc2``'s input.
    """

    def __init__(self, config: TransformerConfig, pstate: ParallelState):
        super().__init__()
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, config=config, pstate=pstate, bias=True,
            gather_output=False, skip_bias_add=True,
        )
        self.linear_fc2 = tensor_parallel.RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, config=config, pstate=pstate, bias=True,
            input_is_parallel=True, skip_bias_add=True, input_bias_gelu=True,
            recompute_input_gelu=config.recomputes("mlp_act"),
        )

    def forward(self, hidden: torch.Tensor):
        """hidden ``[s(/tp under SP), b, h]`` -> (output ``[s(/tp), b, h]``, ``linear_fc2``'s bias)."""
        inter, inter_bias = self.linear_fc1(hidden)  # [s, b, ffn/tp]
        return self.linear_fc2(inter, inter_bias)  # gelu(inter + inter_bias) -> ([s(/tp), b, h], bias)
