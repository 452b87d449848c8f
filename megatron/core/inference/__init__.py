"""Inference: a KV-cached generation engine, sampling, and loading training checkpoints for inference."""

from megatron.core.inference.checkpoint import (
    CheckpointLoadError,
    LoadedModel,
    config_from_args,
    load_gpt_for_inference,
    save_gpt_checkpoint,
)
from megatron.core.inference.engine import GenerationOutput, InferenceEngine
from megatron.core.inference.sampling import SamplingParams, sample_next

__all__ = [
    "CheckpointLoadError", "LoadedModel", "config_from_args", "load_gpt_for_inference", "save_gpt_checkpoint",
    "GenerationOutput", "InferenceEngine", "SamplingParams", "sample_next",
]
