"""Tensor-parallel layers: column- and row-parallel linear layers and the vocab-parallel embedding.

Shapes use Megatron's sequence-first activations ``[s, b, h]``; with ``config.sequence_parallel`` the
activations entering a column-parallel layer and leaving a row-parallel layer are ``[s/tp, b, h]``.

Parameters are allocated with ``torch.empty`` on ``default_device()`` in ``config.params_dtype`` and are *not*
initialised: the model initialises every parameter centrally from the full master tensor and keeps this rank's
slice, which it finds from the parameter's ``tp_sharding`` (``sharding.TPSharding``) set here:

| parameter                      | tp_sharding                          | sequence_parallel        |
|--------------------------------|--------------------------------------|--------------------------|
| ColumnParallelLinear.weight    | output_sharding (TPSharding(0))      |                          |
| ColumnParallelLinear.bias      | output_sharding (TPSharding(0))      |                          |
| RowParallelLinear.weight       | TPSharding(1)                        |                          |
| RowParallelLinear.bias         | None (replicated)                    | config.sequence_parallel |
| VocabParallelEmbedding.weight  | TPSharding(0)                        |                          |

``tensor_model_parallel`` (split or not) and ``partition_dim`` are kept beside it for the code that only needs to
know whether a parameter is split (gradient norm, optimizer copies).

The row-parallel bias is added after the reduction; under sequence parallelism each rank adds it to its own
sequence slice, so its gradient is partial and must be summed over TP (``sequence_parallel = True`` tells
``finalize_model_grads`` to do so).

The layers take a ``LinearConfig`` (``tensor_parallel/config.py``), or any configuration with its attributes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.collectives import all_gather_dim0, reduce_scatter_dim0
from megatron.core.fusions.fp8 import fp8_linear, new_sites
from megatron.core.fusions.linear import accumulate_wgrad, linear_with_grad_accumulation_fusion
from megatron.core.fusions.ops import bias_grad
from megatron.core.grad_record import fused_target
from megatron.core.parallel_state import ParallelState, default_device
from megatron.core.tensor_parallel.config import LinearConfig
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.sharding import TPSharding

_TP_ATTRIBUTES = {"tensor_model_parallel": False, "partition_dim": -1, "tp_sharding": None}


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, blocks: int = 1,
                                         unit: int = 1) -> None:
    """Tag ``param`` with how it is split over TP ranks (read by initialisation, checkpoint tools, grad norm):
    ``tp_sharding = TPSharding(dim, blocks, unit)`` when ``is_parallel``, else None (replicated)."""
    param.tensor_model_parallel = bool(is_parallel)
    param.partition_dim = int(dim) if is_parallel else -1
    param.tp_sharding = TPSharding(int(dim), blocks, unit) if is_parallel else None


def set_defaults_if_not_set_tensor_model_parallel_attributes(param: torch.Tensor) -> None:
    """Give ``param`` the attributes of a replicated (not split) parameter unless it already has them."""
    for name, value in _TP_ATTRIBUTES.items():
        if not hasattr(param, name):
            setattr(param, name, value)


def copy_tensor_model_parallel_attributes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the TP attributes from ``src`` to ``dst`` (e.g. onto an fp32 master copy of a parameter)."""
    for name, default in _TP_ATTRIBUTES.items():
        setattr(dst, name, getattr(src, name, default))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, pstate: ParallelState) -> bool:
    """True for a split parameter, or for a replicated one on TP rank 0: count each element once over TP."""
    return bool(getattr(param, "tensor_model_parallel", False)) or pstate.tp_rank == 0


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by --tensor-model-parallel-size ({denominator})"
        )
    return numerator // denominator


def _empty(shape, config: LinearConfig) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=default_device(), dtype=config.params_dtype))


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """Column-parallel GEMM on a sequence-parallel input that keeps only the local shard for the backward.

    Forward: all-gather ``x [s/tp, b, in] -> [s, b, in]``; ``y = x W^T + b``; save ``x`` (the local shard), so the
    layer keeps ``1/tp`` of its input, as in Korthikanti et al. 2022.
    Backward: all-gather ``x`` again asynchronously while the input-gradient GEMM ``dY W`` runs, then
    reduce-scatter the input gradient along dimension 0 asynchronously while the weight-gradient GEMM runs. With
    ``accumulate`` the weight gradient goes straight into the fp32 ``weight.main_grad`` (``fusions/linear.py``).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, accumulate):
        total = all_gather_dim0(x, group)  # [s, b, in]
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # the Parameter itself, to reach .main_grad under gradient-accumulation fusion
        ctx.group, ctx.has_bias, ctx.accumulate = group, bias is not None, accumulate
        return F.linear(total, weight, bias)  # [s, b, out/tp]

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        pending_total = all_gather_dim0(x, ctx.group, async_op=True) if need_w else None
        grad_x = None
        if need_x:
            grad_total = grad_out.matmul(weight)  # [s, b, in], partial over TP; overlaps the all-gather
            pending_grad_x = reduce_scatter_dim0(grad_total, ctx.group, async_op=True)
        grad_w = grad_b = None
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [s*b, out/tp]
        if need_w:
            total = pending_total.wait()  # [s, b, in]
            total2 = total.reshape(-1, total.shape[-1])
            if ctx.accumulate:
                accumulate_wgrad(ctx.weight, g2, total2)  # into main_grad; the weight gets no .grad
            else:
                grad_w = g2.t().matmul(total2)  # [out/tp, in]; overlaps the reduce-scatter
            del total, total2
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = bias_grad(g2)
        if need_x:
            grad_x = pending_grad_x.wait()  # [s/tp, b, in]
        return grad_x, grad_w, grad_b, None, None


def fp8_sites_for(config: LinearConfig):
    """A linear layer's delayed-scaling sites under ``--fp8-recipe delayed`` (``fp8.new_sites``), else None."""
    if config.fp8 is None or config.fp8_recipe != "delayed":
        return None
    return new_sites(config.fp8_margin, config.fp8_amax_history_len, config.fp8_amax_compute_algo, config.fp8)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], accumulate_fusion: bool,
            config: LinearConfig, fp8_sites=None):
    """``F.linear``; with gradient-accumulation fusion the weight gradient goes straight into ``main_grad``;
    with ``config.fp8`` the GEMMs run in FP8 (``megatron.core.fusions.fp8``), with ``fp8_sites`` under delayed
    scaling."""
    if config.fp8 is not None:
        return fp8_linear(x, weight, bias, config.fp8, config.fp8_margin, accumulate_fusion, sites=fp8_sites)
    if accumulate_fusion:
        return linear_with_grad_accumulation_fusion(x, weight, bias)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns: rank ``r`` holds ``A_r`` and computes ``Y_r = X A_r + b_r``.

    The weight is stored as ``[out/tp, in]`` (``F.linear`` layout), so the output features are split.
    Input ``[s, b, in]`` (or ``[s/tp, b, in]`` under sequence parallelism, all-gathered along dimension 0 first;
    without SP ``f`` is applied so the input gradient is summed over TP). Output ``[s, b, out/tp]``, or the full
    ``[s, b, out]`` with ``gather_output=True``.

    ``skip_bias_add=True`` returns the bias instead of adding it, so the caller can fuse it with the next
    element-wise op. ``skip_weight_param_allocation=True`` allocates no weight; ``forward`` must then be given
    one (the output layer tied to the word embedding).

    Under sequence parallelism only the local ``[s/tp, b, in]`` shard of the input is kept for the weight
    gradient and all-gathered again in the backward, overlapped with the input-gradient GEMM
    (``_SequenceParallelColumnLinear``, as Korthikanti et al. 2022 and Megatron-Core do). FP8 GEMMs
    (``config.fp8``) keep their own FP8 copy of the gathered input instead (1 byte per element of ``[s, b, in]``).

    ``output_sharding`` declares how the output features are split (a ``TPSharding`` along dimension 0): the
    default is a contiguous slice; ``sharding.fc1_sharding(True)`` gives each rank its slice of both halves of a
    fused ``[gate; up]`` output, ``sharding.qkv_sharding`` keeps each query group's QKV rows on one rank.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: LinearConfig,
        pstate: ParallelState,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        output_sharding: Optional[TPSharding] = None,
    ):
        super().__init__()
        config = LinearConfig.of(config)
        self.input_size, self.output_size = input_size, output_size
        self.config = config
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.tp_group, self.tp_size = pstate.tp_group, pstate.tp_size
        self.output_size_per_partition = _divide(output_size, pstate.tp_size, "output size of a column-parallel linear")
        sharding = output_sharding or TPSharding(0)
        if sharding.dim != 0:
            raise ValueError(f"ColumnParallelLinear: its output features are dimension 0, got {sharding}")
        sharding.check(output_size, pstate.tp_size, "output size of a column-parallel linear")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = config.sequence_parallel and pstate.tp_size > 1
        if config.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True is not supported with --sequence-parallel")
        self.fp8_sites = fp8_sites_for(config)
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = _empty((self.output_size_per_partition, input_size), config)
            set_tensor_model_parallel_attributes(self.weight, True, 0, sharding.blocks, sharding.unit)
        if bias:
            self.bias = _empty((self.output_size_per_partition,), config)
            set_tensor_model_parallel_attributes(self.bias, True, 0, sharding.blocks, sharding.unit)
        else:
            self.register_parameter("bias", None)

    def forward(
        self, x: torch.Tensor, weight: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``x [s(/tp), b, in] -> (out [s, b, out/tp] (or [s, b, out] gathered), bias or None)``."""
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear was built with skip_weight_param_allocation=True: "
                                 "forward() needs a weight")
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise ValueError(f"ColumnParallelLinear: weight shape {tuple(weight.shape)} should be "
                             f"{(self.output_size_per_partition, self.input_size)}")
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel and self.config.fp8 is None:
            accumulate = self.gradient_accumulation_fusion and x.is_cuda and fused_target(weight) is not None
            out = _SequenceParallelColumnLinear.apply(x, weight, bias, self.tp_group, accumulate)  # [s, b, out/tp]
        else:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, self.tp_group)  # [s, b, in]
            else:
                x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # [s, b, in]
            out = _linear(x, weight, bias, self.gradient_accumulation_fusion, self.config,
                          self.fp8_sites)  # [s, b, out/tp]
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)  # [s, b, out]
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (per rank {self.output_size_per_partition}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows: rank ``r`` holds ``A_r`` and computes the partial ``X_r A_r``.

    The weight is stored as ``[out, in/tp]``. The input is ``[s, b, in/tp]`` (``input_is_parallel=True``, the
    output of a column-parallel layer) or the full ``[s, b, in]``, which is then split along its last dimension.
    The partial products are summed with ``g`` (all-reduce) to ``[s, b, out]``, or under sequence parallelism
    reduce-scattered along dimension 0 to ``[s/tp, b, out]``. The bias is added after the reduction (or returned
    with ``skip_bias_add=True``).

    ``forward(x)`` is ``reduce(partial_product(x))``; a caller that computes this rank's partial product itself
    (the MLP, fusing its activation into the GEMM) hands it to ``reduce``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: LinearConfig,
        pstate: ParallelState,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
    ):
        super().__init__()
        config = LinearConfig.of(config)
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.tp_size = pstate.tp_group, pstate.tp_size
        self.input_size_per_partition = _divide(input_size, pstate.tp_size, "input size of a row-parallel linear")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.config = config
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.sequence_parallel = config.sequence_parallel and pstate.tp_size > 1
        if config.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: --sequence-parallel needs input_is_parallel=True")
        self.weight = _empty((output_size, self.input_size_per_partition), config)
        set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
        self.fp8_sites = fp8_sites_for(config)
        if bias:
            self.bias = _empty((output_size,), config)
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            self.bias.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``x [s, b, in/tp] -> (out [s(/tp), b, out], bias or None)``."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # [s, b, in/tp]
        return self.reduce(self.partial_product(x))

    def partial_product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x A_r`` ``[s, b, out]``, before the reduction."""
        return _linear(x, self.weight, None, self.gradient_accumulation_fusion, self.config, self.fp8_sites)

    def reduce(self, partial: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sum the partial products ``[s, b, out]`` over TP (reduce-scatter to ``[s/tp, b, out]`` under sequence
        parallelism), then add the bias or return it (``skip_bias_add``)."""
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s/tp, b, out]
        else:
            out = reduce_from_tensor_model_parallel_region(partial, self.tp_group)  # [s, b, out]
        if self.skip_bias_add or self.bias is None:
            return out, self.bias if self.skip_bias_add else None
        return out + self.bias, None

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (per rank {self.input_size_per_partition}), out={self.output_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: rank ``r`` holds rows ``[r V/tp, (r+1) V/tp)``.

    Each rank looks up the ids that fall in its range, writes zeros for the others, and the partial results are
    summed over TP with ``g``. ``forward(ids [b, s]) -> [b, s, h]``, identical on every TP rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config: LinearConfig, pstate: ParallelState):
        super().__init__()
        config = LinearConfig.of(config)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_size = pstate.tp_group, pstate.tp_size
        self.num_embeddings_per_partition = _divide(num_embeddings, pstate.tp_size, "padded vocabulary size")
        self.vocab_start_index = pstate.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = _empty((self.num_embeddings_per_partition, embedding_dim), config)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` (int64, e.g. ``[s, b]``) ``-> [..., h]``."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)  # [..., h]
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)  # [...]
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight)  # [..., h]
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)  # [..., h]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start_index}:"
                f"{self.vocab_end_index} on this rank)")
