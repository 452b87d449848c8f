"""Tensor and sequence parallelism: communication operators, parallel layers, vocab-parallel loss, RNG, data."""

from megatron.core.collectives import count_collectives
from megatron.core.tensor_parallel.config import LinearConfig
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.data import broadcast_data
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.sharding import TPSharding
from megatron.core.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_all_rng_states,
    get_rng_tracker,
    model_parallel_seed,
    set_all_rng_states,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "LinearConfig", "TPSharding",
    "copy_tensor_model_parallel_attributes", "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes", "set_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region", "count_collectives", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region", "vocab_parallel_cross_entropy", "broadcast_data",
    "MODEL_PARALLEL_RNG", "RNGStatesTracker", "checkpoint", "get_all_rng_states", "get_rng_tracker",
    "model_parallel_seed", "set_all_rng_states",
]
