"""The Megatron-LM compatible command line: parsed once, validated once, frozen into ``RunConfig``.

``flag_table.py`` first translates, drops or refuses Megatron-LM flags this parser does not define; the parser
then reads the rest; ``validate`` checks the whole and fills derived values; ``RunConfig.from_namespace`` freezes
the sections. Every problem is a ``ConfigError`` with one line naming the flag and the value.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.core.model_spec import swiglu_ffn_hidden_size
from megatron.training.config import RunConfig, pad_vocab_size
from megatron.training.flag_table import ConfigError, closest, rewrite_argv
from megatron.training.parser import build_parser

# Megatron-LM values of implemented flags that are refused by name: flag -> supported values
SUPPORTED_CHOICES = {
    "transformer_impl": ("--transformer-impl", ("local",)),
    "ckpt_format": ("--ckpt-format", ("torch", "torch_dist")),
}


# --attention-backend (Megatron-LM's names) -> the TransformerConfig kernel
ATTENTION_BACKENDS = {"auto": "sdpa", "flash": "flash", "fused": "cudnn", "unfused": "unfused", "local": "unfused"}


class _Parser(argparse.ArgumentParser):
    """Errors become ``ConfigError`` (one line, no usage text), with the closest flag names for unknown ones."""

    def error(self, message: str):
        raise ConfigError(message)

    def parse_args(self, args=None, namespace=None):
        ns, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flags = [u for u in unknown if u.startswith("-")]
            first = (flags or unknown)[0].split("=", 1)[0]
            msg = f"unrecognized arguments: {' '.join(unknown)}"
            near = closest(first, self.known_flags())
            if near:
                msg += f" (did you mean {' or '.join(near)}?)"
            raise ConfigError(msg)
        return ns

    def known_flags(self) -> List[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]


def make_parser(extra_sections=(), **kwargs) -> _Parser:
    """The trainer's parser with the entry point's sections; ``kwargs`` go to ``argparse.ArgumentParser``."""
    kwargs.setdefault("description", "Megatron-style pretraining")
    parser = _Parser(allow_abbrev=False, **kwargs)
    build_parser(parser)
    for section in extra_sections:
        section.add_arguments(parser)
    return parser


def _fail(msg: str):
    raise ConfigError(msg)


def _check_cuda_graph(ns: argparse.Namespace, world_size: int) -> None:
    """--enable-cuda-graph captures one whole iteration; reject what that capture cannot hold, by name."""
    if not torch.cuda.is_available():
        _fail("--enable-cuda-graph needs a CUDA GPU")
    if world_size != 1:
        _fail(f"--enable-cuda-graph runs on one GPU (world size 1), got world size {world_size}")
    if ns.fp16:
        _fail("--enable-cuda-graph needs --bf16 or fp32 (fp16 loss scaling reads overflow flags on the host)")
    if ns.use_distributed_optimizer:
        _fail("--enable-cuda-graph does not combine with --use-distributed-optimizer (one GPU has nothing to shard)")
    if ns.optimizer != "adam":
        _fail("--enable-cuda-graph needs --optimizer adam (the captured step is torch's fused AdamW)")
    if ns.attention_dropout > 0.0:
        _fail("--enable-cuda-graph needs --attention-dropout 0 (the attention dropout generator is switched "
              "on the host)")
    if ns.recompute_granularity == "full" or (ns.recompute_granularity == "selective"
                                              and "core_attn" in ns.recompute_modules):
        _fail("--enable-cuda-graph cannot capture recomputation that restores RNG states: use no recomputation "
              "or --recompute-granularity selective --recompute-modules mlp_act")
    if ns.cuda_graph_warmup_steps < 1:
        _fail(f"--cuda-graph-warmup-steps must be >= 1, got {ns.cuda_graph_warmup_steps}")


def _check_fp8(ns: argparse.Namespace, tp: int) -> None:
    """--fp8-format: bf16 master run, eager layers, and GEMM sizes cuBLAS FP8 accepts (multiples of 16)."""
    if not ns.bf16:
        _fail("--fp8-format needs --bf16 (FP8 GEMMs inside a bf16 model)")
    if ns.use_torch_compile:
        _fail("--fp8-format does not combine with --use-torch-compile")
    if ns.fp8_recipe != "delayed" and (ns.fp8_amax_history_len != 1 or ns.fp8_amax_compute_algo != "most_recent"):
        _fail("--fp8-amax-history-len and --fp8-amax-compute-algo need --fp8-recipe delayed")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        _fail(f"--fp8-format needs an FP8 GPU (compute capability 8.9 or newer), this one is {major}.{minor}")
    seq = ns.seq_length // tp if ns.sequence_parallel else ns.seq_length
    sizes = {"--micro-batch-size x --seq-length" + (" / tp" if ns.sequence_parallel else ""):
             ns.micro_batch_size * seq, "--hidden-size / tp": ns.hidden_size // tp,
             "--ffn-hidden-size / tp": ns.ffn_hidden_size // tp, "--hidden-size": ns.hidden_size}
    bad = [f"{name} = {v}" for name, v in sizes.items() if v % 16]
    if bad:
        _fail(f"--fp8-format needs GEMM sizes that are multiples of 16: {', '.join(bad)}")


def _check_model(ns: argparse.Namespace, tp: int) -> None:
    """Model-shape checks live in the library's ModelSpec and TransformerConfig; build one to run them."""
    from megatron.training.config import ModelConfig, PrecisionConfig, section_from_namespace, transformer_config

    try:
        cfg = transformer_config(section_from_namespace(ModelConfig, ns), section_from_namespace(PrecisionConfig, ns),
                                 ns.sequence_parallel, padded_vocab_size=0)
        cfg.check_tensor_parallel(tp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _resolve_backend(ns: argparse.Namespace) -> None:
    if ns.distributed_backend is None:
        ns.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if ns.distributed_backend == "nccl" and not torch.cuda.is_available():
        _fail("--distributed-backend nccl needs CUDA GPUs; this machine has none (use --distributed-backend gloo)")
    if not ns.distributed_timeout_minutes > 0:
        _fail(f"--distributed-timeout-minutes must be above 0, got {ns.distributed_timeout_minutes:g}")


def validate(ns: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check consistency and fill derived values in place; raise ``ConfigError`` naming the flag and numbers."""
    from megatron.core.parallel_state import validate_parallel_sizes
    from megatron.core.pipeline_parallel.partition import layers_for_stage

    for dest, (flag, supported) in SUPPORTED_CHOICES.items():
        if getattr(ns, dest) not in supported:
            _fail(f"{flag} {getattr(ns, dest)} is not supported; supported: {', '.join(supported)}")
    if ns.tokenizer_type == "NullTokenizer" and (ns.vocab_size is None or ns.vocab_size < 1):
        _fail(f"--tokenizer-type NullTokenizer needs --vocab-size N >= 1 (ids 0..N-1, end of document N), got "
              f"{ns.vocab_size}")
    if ns.vocab_size is not None and ns.tokenizer_type != "NullTokenizer":
        _fail(f"--vocab-size {ns.vocab_size} is read by --tokenizer-type NullTokenizer only (the "
              f"{ns.tokenizer_type} vocabulary comes from its files)")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        if getattr(ns, name) is None:
            _fail(f"--{name.replace('_', '-')} is required" +
                  (" (or --use-checkpoint-args with --load)" if name != "micro_batch_size" else ""))
        if getattr(ns, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if ns.ckpt_format == "torch_dist" and (tp, pp, ns.virtual_pipeline_model_parallel_size or 1) != (1, 1, 1):
        _fail(f"--ckpt-format torch_dist is written by runs of TP=1 and PP=1 (this run: TP={tp}, PP={pp}); save "
              "in the default format and convert it with tools/checkpoint/convert.py --saver torch_dist")
    if ns.ckpt_format == "torch_dist" and ns.ckpt_layout == "megatron":
        _fail("give only one of --ckpt-format torch_dist and --ckpt-layout megatron")
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        if ns.virtual_pipeline_model_parallel_size is not None:
            _fail("give only one of --num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size")
        per_stage = ns.num_layers // pp
        if ns.num_layers % pp or per_stage % ns.num_layers_per_virtual_pipeline_stage:
            _fail(f"--num-layers ({ns.num_layers}) / --pipeline-model-parallel-size ({pp}) must be divisible by "
                  f"--num-layers-per-virtual-pipeline-stage ({ns.num_layers_per_virtual_pipeline_stage})")
        ns.virtual_pipeline_model_parallel_size = per_stage // ns.num_layers_per_virtual_pipeline_stage
    if ns.virtual_pipeline_model_parallel_size == 1:
        ns.virtual_pipeline_model_parallel_size = None
    try:
        ns.data_parallel_size = validate_parallel_sizes(world_size, tp, pp, ns.virtual_pipeline_model_parallel_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    ns.world_size = world_size
    dp = ns.data_parallel_size
    _resolve_backend(ns)

    if ns.ffn_hidden_size is None:
        ns.ffn_hidden_size = swiglu_ffn_hidden_size(ns.hidden_size) if ns.swiglu else 4 * ns.hidden_size
    if ns.max_position_embeddings is None:
        ns.max_position_embeddings = ns.seq_length
    if ns.recompute_activations:
        if ns.recompute_granularity not in (None, "selective"):
            _fail("--recompute-activations means --recompute-granularity selective")
        ns.recompute_granularity = "selective"
    if ns.recompute_granularity == "full" and ns.recompute_num_layers is None and ns.recompute_method is not None:
        ns.recompute_num_layers = 1
    ns.params_dtype = "bfloat16" if ns.bf16 else ("float16" if ns.fp16 else "float32")
    if ns.no_masked_softmax_fusion:
        ns.attention_backend = "unfused"
    ns.attention_backend = ATTENTION_BACKENDS[ns.attention_backend]
    if ns.bf16 and ns.fp16:
        _fail("give only one of --bf16 and --fp16")
    if ns.max_consecutive_skipped_iterations < 0:
        _fail(f"--max-consecutive-skipped-iterations must be >= 0 (0: never stop), got "
              f"{ns.max_consecutive_skipped_iterations}")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(ns, name) < 1.0:
            _fail(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(ns, name)}")
    _check_model(ns, tp)
    try:  # the library's layer split checks every stage (even, uneven and interleaved splits)
        layers_for_stage(ns.num_layers, pp, 0, ns.virtual_pipeline_model_parallel_size, 0,
                         ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size * dp
    if ns.global_batch_size % (ns.micro_batch_size * dp):
        _fail(f"--global-batch-size ({ns.global_batch_size}) must be a multiple of --micro-batch-size "
              f"({ns.micro_batch_size}) x data-parallel size ({dp}) = {ns.micro_batch_size * dp}")
    ns.num_microbatches = ns.global_batch_size // (ns.micro_batch_size * dp)
    if ns.virtual_pipeline_model_parallel_size and ns.num_microbatches % pp:
        _fail(f"interleaved pipelining needs the number of microbatches ({ns.num_microbatches} = "
              f"--global-batch-size / (--micro-batch-size x DP)) to be a multiple of "
              f"--pipeline-model-parallel-size ({pp})")

    if (ns.train_iters is None) == (ns.train_samples is None) and not ns.skip_train:
        _fail("give exactly one of --train-iters and --train-samples")
    if ns.train_samples is not None:
        if ns.train_samples < ns.global_batch_size:
            _fail(f"--train-samples ({ns.train_samples}) is smaller than --global-batch-size "
                  f"({ns.global_batch_size})")
        ns.train_iters = ns.train_samples // ns.global_batch_size
    if ns.train_iters is None:
        ns.train_iters = 0
    if ns.lr is None:
        _fail("--lr is required")
    if ns.min_lr > ns.lr:
        _fail(f"--min-lr ({ns.min_lr}) is larger than --lr ({ns.lr})")
    if ns.lr_warmup_fraction is not None and ns.lr_warmup_iters:
        _fail("give only one of --lr-warmup-iters and --lr-warmup-fraction")
    if ns.lr_decay_iters is None:
        ns.lr_decay_iters = ns.train_iters
    if ns.lr_warmup_fraction is not None:
        if not 0.0 <= ns.lr_warmup_fraction <= 1.0:
            _fail(f"--lr-warmup-fraction must be in [0, 1], got {ns.lr_warmup_fraction}")
        ns.lr_warmup_iters = int(ns.lr_warmup_fraction * ns.lr_decay_iters)
    if ns.lr_warmup_iters > max(ns.lr_decay_iters, 0) and ns.lr_decay_style != "constant":
        _fail(f"--lr-warmup-iters ({ns.lr_warmup_iters}) exceeds --lr-decay-iters ({ns.lr_decay_iters})")
    for name in ("log_interval", "eval_interval", "make_vocab_size_divisible_by", "tensorboard_log_interval",
                 "tensorboard_queue_size"):
        if getattr(ns, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    for name in ("eval_iters", "num_workers"):
        if getattr(ns, name) < 0:
            _fail(f"--{name.replace('_', '-')} must be >= 0, got {getattr(ns, name)}")
    if ns.save_interval is not None and ns.save_interval < 1:
        _fail(f"--save-interval must be >= 1, got {ns.save_interval}")
    if ns.use_checkpoint_args and ns.load is None:
        _fail("--use-checkpoint-args needs --load")
    if ns.exit_on_missing_checkpoint and ns.load is None:
        _fail("--exit-on-missing-checkpoint needs --load")
    if ns.keep_last_checkpoints is not None and ns.keep_last_checkpoints < 1:
        _fail(f"--keep-last-checkpoints must be >= 1, got {ns.keep_last_checkpoints}")
    if ns.keep_last_checkpoints is not None and ns.save is None:
        _fail("--keep-last-checkpoints needs --save")
    if ns.mock_data and ns.data_path:
        _fail("give only one of --mock-data and --data-path")
    if not ns.data_path and not ns.mock_data:
        _fail("--data-path is required (a preprocessed prefix, or weights and prefixes), or --mock-data")
    if ns.overlap_param_gather and not ns.use_distributed_optimizer:
        _fail("--overlap-param-gather needs --use-distributed-optimizer")
    if ns.wandb_exp_name is not None and ns.wandb_project is None:
        _fail("--wandb-exp-name needs --wandb-project")
    if ns.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        _fail(f"--wandb-project {ns.wandb_project} needs the wandb package (pip install wandb)")
    if ns.enable_cuda_graph:
        _check_cuda_graph(ns, world_size)
    if ns.fp8_format is not None:
        _check_fp8(ns, tp)
    from megatron.training.downstream_eval import validate_eval_tasks

    validate_eval_tasks(ns)
    return ns


# Model-shape flags --use-checkpoint-args takes from the checkpoint when the command line leaves them out
# (their parser default is None), and the default each gets otherwise.
CHECKPOINT_ARGS = {"num_layers": None, "hidden_size": None, "num_attention_heads": None, "ffn_hidden_size": None,
                   "seq_length": None, "max_position_embeddings": None, "make_vocab_size_divisible_by": 128,
                   "norm_epsilon": 1e-5, "apply_layernorm_1p": False, "untie_embeddings_and_output_weights": False,
                   "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
                   "rotary_interleaved": False, "rotary_seq_len_interpolation_factor": None,
                   "use_rope_scaling": False, "rope_scaling_factor": 8.0, "normalization": "LayerNorm",
                   "swiglu": False, "group_query_attention": False, "num_query_groups": 1, "kv_channels": None,
                   "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
                   "tokenizer_type": "GPT2BPETokenizer"}


def _fill_from_checkpoint(ns: argparse.Namespace) -> None:
    """--use-checkpoint-args: model-shape flags not given on the command line come from the checkpoint."""
    from megatron.training.checkpointing import CheckpointError, read_saved_args

    try:
        saved = read_saved_args(ns.load)
    except CheckpointError as exc:
        raise ConfigError(f"--use-checkpoint-args: {exc}") from None
    if "norm_epsilon" not in saved and "layernorm_epsilon" in saved:  # the older name
        saved["norm_epsilon"] = saved["layernorm_epsilon"]
    for name in CHECKPOINT_ARGS:
        if getattr(ns, name) is None and saved.get(name) is not None:
            setattr(ns, name, saved[name])
    if ns.tokenizer_type == "NullTokenizer" and ns.vocab_size is None and saved.get("vocab_size") is not None:
        ns.vocab_size = int(saved["vocab_size"])  # the null tokenizer's size belongs to the saved tokenizer


def parse_namespace(argv: Optional[Sequence[str]] = None, world_size: int = 1,
                    extra_sections=()) -> Tuple[argparse.Namespace, List[str]]:
    """Rewrite, parse and validate; returns the validated namespace and the rank-0 notes."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser(extra_sections)
    argv, notes = rewrite_argv(argv, parser.known_flags())
    ns = parser.parse_args(argv)
    if ns.use_checkpoint_args and ns.load:
        _fill_from_checkpoint(ns)
    for section in extra_sections:
        if section.prepare is not None:
            section.prepare(ns, world_size)
    for name, default in CHECKPOINT_ARGS.items():
        if getattr(ns, name) is None:
            setattr(ns, name, default)
    validate(ns, world_size)
    if ns.save_interval is not None and ns.save is None:
        notes.append(f"note: --save-interval {ns.save_interval} has no effect without --save; nothing is saved")
    for section in extra_sections:
        if section.validate is not None:
            section.validate(ns)
    return ns, notes


def parse_config(argv: Optional[Sequence[str]] = None, world_size: int = 1,
                 extra_sections=()) -> Tuple[RunConfig, List[str]]:
    """The frozen configuration of a run, and the notes to print on rank 0."""
    ns, notes = parse_namespace(argv, world_size, extra_sections)
    return RunConfig.from_namespace(ns, extra_sections), notes


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


__all__ = ["ConfigError", "parse_config", "parse_namespace", "validate", "make_parser", "pad_vocab_size"]
