"""The run's configuration: frozen, typed sections built once from the validated command line.

Each component receives only its section (the optimizer its ``OptimizerSection``, checkpointing its
``CheckpointConfig``, ...). Values derived from the flags (data-parallel size, number of microbatches, iteration
counts) are filled in by validation before the sections are frozen; values derived from the tokenizer (padded
vocabulary, end-of-document id) are computed once by ``pretrain()`` and carried in ``TrainingContext``.

An entry point adds its own section with ``ExtraSection`` (see docs/training.md).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Tuple

import torch


def section_from_namespace(cls, ns: argparse.Namespace):
    """An instance of the frozen dataclass ``cls`` whose fields are the same-named (validated) flags."""
    values = {}
    for f in dataclasses.fields(cls):
        v = getattr(ns, f.name)
        values[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**values)


@dataclass(frozen=True)
class ModelConfig:
    """The model flags as given (Megatron-LM's names); ``spec()`` is the model they describe."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    make_vocab_size_divisible_by: int
    norm_epsilon: float
    apply_layernorm_1p: bool
    untie_embeddings_and_output_weights: bool
    position_embedding_type: str
    rotary_base: int
    rotary_percent: float
    rotary_interleaved: bool
    rotary_seq_len_interpolation_factor: Optional[int]
    use_rope_scaling: bool
    rope_scaling_factor: float
    normalization: str
    swiglu: bool
    group_query_attention: bool
    num_query_groups: int
    kv_channels: Optional[int]
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    init_method_std: float
    attention_dropout: float
    hidden_dropout: float
    attention_backend: str  # a TransformerConfig kernel name: sdpa, flash, cudnn or unfused
    recompute_granularity: Optional[str]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]
    recompute_modules: Tuple[str, ...]
    use_torch_compile: bool
    bias_gelu_fusion: bool
    bias_dropout_fusion: bool
    persist_layer_norm: bool
    cross_entropy_loss_fusion: bool
    gradient_accumulation_fusion: bool

    def spec(self, padded_vocab_size: int, **overrides):
        """The ``ModelSpec`` these flags describe, with the vocabulary padded by the trainer."""
        from megatron.core.model_spec import spec_from_args

        return spec_from_args(dataclasses.asdict(self), padded_vocab_size=padded_vocab_size, **overrides)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    decoder_first_pipeline_num_layers: Optional[int]
    decoder_last_pipeline_num_layers: Optional[int]
    sequence_parallel: bool
    distributed_backend: str  # resolved: nccl or gloo
    distributed_timeout_minutes: float
    world_size: int
    data_parallel_size: int
    overlap_grad_reduce: bool
    ddp_bucket_size: Optional[int]
    local_rank_from_launcher: Optional[int]  # --local-rank from torch.distributed.launch (LOCAL_RANK wins)


@dataclass(frozen=True)
class PrecisionConfig:
    bf16: bool
    fp16: bool
    params_dtype: str  # bfloat16, float16 or float32
    loss_scale: Optional[float]
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    fp8_format: Optional[str]
    fp8_recipe: str
    fp8_amax_history_len: int
    fp8_amax_compute_algo: str
    fp8_margin: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.params_dtype]


@dataclass(frozen=True)
class OptimizerSection:
    optimizer: str
    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float
    use_distributed_optimizer: bool
    overlap_param_gather: bool
    fused_adamw: bool


@dataclass(frozen=True)
class SchedulerConfig:
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int
    weight_decay: float


@dataclass(frozen=True)
class DataConfig:
    data_path: Optional[Tuple[str, ...]]
    split: str
    data_cache_path: Optional[str]
    mock_data: bool
    tokenizer_type: str
    vocab_file: Optional[str]
    merge_file: Optional[str]
    tokenizer_model: Optional[str]
    num_workers: int
    eod_mask_loss: bool
    vocab_size: Optional[int] = None  # NullTokenizer's --vocab-size


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    no_save_optim: bool
    no_save_rng: bool
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    use_checkpoint_args: bool
    exit_on_missing_checkpoint: bool
    ckpt_fallback_on_corruption: bool
    keep_last_checkpoints: Optional[int]
    ckpt_layout: str = "ours"  # "megatron": --save writes Megatron-LM's legacy layout
    ckpt_format: str = "torch"  # "torch_dist": --save writes Megatron-LM's torch_dist layout


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    log_throughput: bool
    tensorboard_dir: Optional[str]
    tensorboard_log_interval: int
    tensorboard_queue_size: int
    wandb_project: Optional[str]
    wandb_exp_name: Optional[str]
    wandb_save_dir: Optional[str]
    wandb_entity: Optional[str]


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int  # derived: global batch / (micro batch x data-parallel size)
    train_iters: int  # derived from --train-samples when that is given
    eval_interval: int
    eval_iters: int
    skip_train: bool
    exit_interval: Optional[int]
    exit_duration_in_mins: Optional[float]
    exit_signal_handler: bool
    exit_signal: str  # SIGTERM, SIGINT, SIGUSR1 or SIGUSR2
    max_consecutive_skipped_iterations: int  # 0: never stop
    check_for_nan_in_loss_and_grad: bool
    seed: int
    enable_cuda_graph: bool
    cuda_graph_warmup_steps: int


@dataclass(frozen=True)
class DownstreamEvalConfig:
    """``--eval-tasks``: zero-shot tasks scored on the model being trained (``downstream_eval.py``)."""
    eval_tasks: Tuple[str, ...]  # lambada and/or wikitext; empty: none
    eval_lambada_data: Optional[str]
    eval_wikitext_data: Optional[str]
    eval_strict_lambada: bool
    eval_overlapping_eval: Optional[int]  # WikiText window stride (None: --seq-length, no overlap)
    eval_tasks_max_examples: Optional[int]  # per task: the first N passages / windows (None: all)


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "precision": PrecisionConfig,
            "optimizer": OptimizerSection, "scheduler": SchedulerConfig, "data": DataConfig,
            "checkpointing": CheckpointConfig, "logging": LoggingConfig, "training": TrainingConfig,
            "downstream_eval": DownstreamEvalConfig}


@dataclass(frozen=True)
class ExtraSection:
    """An entry point's own section: its flags, its frozen dataclass and its checks.

    ``add_arguments(parser)`` adds the flags (with help); ``prepare(ns, world_size)`` (optional) runs before the
    trainer's validation; ``validate(ns)`` may check them and fill derived values
    (raise ``ConfigError``) before ``cls`` is built from the same-named attributes. The section then appears in
    ``RunConfig.extra[name]`` and in the checkpoint's stored arguments.
    """
    name: str
    cls: type
    add_arguments: Callable[[argparse.ArgumentParser], None]
    validate: Optional[Callable[[argparse.Namespace], None]] = None
    # ``prepare(ns, world_size)`` runs before the trainer's own validation: it may fill trainer flags the section
    # decides (e.g. --train-iters from a number of epochs, model sizes from a pre-trained checkpoint)
    prepare: Optional[Callable[[argparse.Namespace, int], None]] = None


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    optimizer: OptimizerSection
    scheduler: SchedulerConfig
    data: DataConfig
    checkpointing: CheckpointConfig
    logging: LoggingConfig
    training: TrainingConfig
    downstream_eval: DownstreamEvalConfig
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, extra_sections=()) -> "RunConfig":
        sections = {name: section_from_namespace(sec, ns) for name, sec in SECTIONS.items()}
        extra = {s.name: section_from_namespace(s.cls, ns) for s in extra_sections}
        return cls(**sections, extra=MappingProxyType(extra))

    def to_plain_dict(self) -> dict:
        """Every field as plain Python types (what checkpoints store; loads with ``weights_only=True``)."""
        out = {}
        for section in [getattr(self, name) for name in SECTIONS] + list(self.extra.values()):
            for f in dataclasses.fields(section):
                v = getattr(section, f.name)
                out[f.name] = list(v) if isinstance(v, tuple) else v
        out["layernorm_epsilon"] = self.model.norm_epsilon  # the name older checkpoints of this project use
        return out


@dataclass(frozen=True)
class TrainingContext:
    """What an entry point's model provider, forward step and datasets provider receive."""
    config: RunConfig
    pstate: Any  # megatron.core.parallel_state.ParallelState
    tokenizer: Any
    padded_vocab_size: int
    eod_id: int


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` at or above ``vocab_size`` (Megatron's padding)."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def transformer_config(model: ModelConfig, precision: PrecisionConfig, sequence_parallel: bool,
                       padded_vocab_size: int, **spec_overrides):
    """The library's ``TransformerConfig``: the model's spec plus the runtime switches of these sections (it
    validates the model itself). ``spec_overrides``: spec fields an entry point fixes (BERT's attention mask)."""
    from megatron.core.transformer.config import TransformerConfig

    config = TransformerConfig.from_spec(
        model.spec(padded_vocab_size, **spec_overrides),
        attention_dropout=model.attention_dropout, hidden_dropout=model.hidden_dropout,
        init_method_std=model.init_method_std, params_dtype=precision.torch_dtype,
        sequence_parallel=sequence_parallel, recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method, recompute_num_layers=model.recompute_num_layers,
        recompute_modules=model.recompute_modules, attention_backend=model.attention_backend,
        bias_gelu_fusion=model.bias_gelu_fusion, bias_dropout_fusion=model.bias_dropout_fusion,
        layernorm_fusion=model.persist_layer_norm,
        gradient_accumulation_fusion=model.gradient_accumulation_fusion,
        fp8=precision.fp8_format, fp8_margin=precision.fp8_margin, fp8_recipe=precision.fp8_recipe,
        fp8_amax_history_len=precision.fp8_amax_history_len, fp8_amax_compute_algo=precision.fp8_amax_compute_algo,
    )
    return config
