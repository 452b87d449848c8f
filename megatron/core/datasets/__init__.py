"""Token datasets: the mmapped .bin/.idx format, GPT samples, blending and the pretraining sampler."""

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.builder import build_gpt_datasets, parse_data_path, parse_split
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from megatron.core.datasets.samplers import MegatronPretrainingSampler, build_pretraining_data_loader

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingSampler",
    "build_gpt_datasets",
    "build_pretraining_data_loader",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
]
