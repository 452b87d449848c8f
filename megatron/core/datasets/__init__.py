"""Token datasets: the mmapped .bin/.idx format, GPT and BERT samples, blending and the pretraining sampler.

Names are imported lazily so that preprocessing (which needs no torch) starts quickly.
"""

import importlib

_EXPORTS = {
    "BERTMaskedDataset": "megatron.core.datasets.bert_dataset",
    "BertDatasetConfig": "megatron.core.datasets.bert_dataset",
    "WordPieceVocab": "megatron.core.datasets.bert_dataset",
    "MaskingConfig": "megatron.core.datasets.masking",
    "BlendedDataset": "megatron.core.datasets.blended_dataset",
    "GPTDataset": "megatron.core.datasets.gpt_dataset",
    "IndexedDataset": "megatron.core.datasets.indexed_dataset",
    "IndexedDatasetBuilder": "megatron.core.datasets.indexed_dataset",
    "optimal_dtype": "megatron.core.datasets.indexed_dataset",
    "MegatronPretrainingSampler": "megatron.core.datasets.samplers",
    "build_pretraining_data_loader": "megatron.core.datasets.samplers",
    "build_gpt_datasets": "megatron.core.datasets.builder",
    "build_bert_datasets": "megatron.core.datasets.builder",
    "parse_data_path": "megatron.core.datasets.builder",
    "parse_split": "megatron.core.datasets.builder",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron.core.datasets' has no attribute {name!r}")


def __dir__():
    return __all__
