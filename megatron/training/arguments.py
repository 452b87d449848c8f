"""Megatron-LM compatible command line, validated once, turned into typed config sections."""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch

from megatron.core.fusions.fp8 import FP8_FORMATS

# Megatron-LM flags this framework knows but does not implement: named in the error instead of "unrecognized".
UNSUPPORTED_MEGATRON_FLAGS = {
    "--num-experts": "mixture of experts",
    "--expert-model-parallel-size": "mixture of experts",
    "--context-parallel-size": "context parallelism",
    "--swiglu": "SwiGLU MLP",
    "--use-rotary-position-embeddings": "rotary position embeddings",
    "--rotary-percent": "rotary position embeddings",
    "--group-query-attention": "grouped-query attention",
    "--num-query-groups": "grouped-query attention",
    "--disable-bias-linear": "bias-free linear layers",
    "--rampup-batch-size": "batch-size ramp-up",
    "--reset-position-ids": "per-document position ids",
    "--reset-attention-mask": "per-document attention masks",
    "--train-data-path": "separate train/valid/test data paths (use --data-path with --split)",
    "--valid-data-path": "separate train/valid/test data paths (use --data-path with --split)",
    "--test-data-path": "separate train/valid/test data paths (use --data-path with --split)",
    "--fp8-param-gather": "FP8 parameter all-gather",
    "--tp-comm-overlap": "Transformer Engine communication overlap",
    "--use-dist-ckpt": "distributed (torch_dist) checkpoints; checkpoints are per-rank torch files",
    "--lr-warmup-samples": "sample-based warm-up (use --lr-warmup-iters or --lr-warmup-fraction)",
    "--lr-decay-samples": "sample-based decay (use --lr-decay-iters)",
    "--no-async-tensor-model-parallel-allreduce": "asynchronous TP all-reduce switches",
    "--use-cpu-initialization": "CPU initialisation switch (initialisation is always layout independent)",
}
UNSUPPORTED_CHOICES = {
    "--position-embedding-type": ("learned_absolute",),
    "--normalization": ("LayerNorm",),
    "--transformer-impl": ("local",),
    "--ckpt-format": ("torch",),
    "--fp8-recipe": ("tensorwise", "delayed"),
}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true", help="zero-centred LayerNorm gamma")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", default="learned_absolute")
    g.add_argument("--normalization", default="LayerNorm")
    g.add_argument("--transformer-impl", default="local")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted; models always use Megatron-Core names")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "flash", "fused", "unfused", "local"],
                   help="auto: PyTorch's SDPA picks the kernel; flash: SDPA's flash kernel only; fused: SDPA's "
                        "cuDNN kernel only (flash and fused need CUDA); unfused/local: explicit "
                        "scale-mask-softmax")
    g.add_argument("--use-flash-attn", action="store_true", help="accepted; attention uses SDPA by default")

    g = p.add_argument_group("regularisation")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)

    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--no-fused-adamw", dest="fused_adamw", action="store_false",
                   help="on CUDA, use torch's fused AdamW and a separate copy into the bf16/fp16 params instead of "
                        "the Triton AdamW that writes them in its update")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accepted; gradients always accumulate in fp32")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--fp8-format", default=None, choices=list(FP8_FORMATS),
                   help="FP8 GEMMs in the transformer layers' linears (needs --bf16 and an FP8 GPU, sm89+): e4m3 "
                        "everywhere, or hybrid (E5M2 output gradients)")
    g.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "delayed"],
                   help="FP8 scaling: tensorwise = each tensor scaled by its own current amax; delayed = by the "
                        "amax its quantization site saw in earlier iterations (no amax pass before the cast)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="--fp8-recipe delayed: iterations of amax history per quantization site")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="--fp8-recipe delayed: the scale's amax is the latest one or the history's maximum")
    g.add_argument("--fp8-margin", type=int, default=0, help="FP8 scale = fp8_max / amax / 2^margin")

    g = p.add_argument_group("batches and schedule")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true", help="accepted; memory is always logged on GPU")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train", action="store_true")

    g = p.add_argument_group("checkpoints and stopping")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-format", default="torch")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("recomputation and kernels")
    g.add_argument("--recompute-activations", action="store_true", help="same as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", default=None, choices=["selective", "full"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full: layers per recomputed group (uniform) or recomputed layers per stage (block); "
                        "selective: recompute only in the first N layers of each stage (default all)")
    g.add_argument("--recompute-modules", nargs="+", default=["core_attn", "mlp_act"],
                   choices=["core_attn", "mlp_act"],
                   help="what --recompute-granularity selective recomputes: the attention core and/or the MLP's "
                        "GeLU output (default both)")
    g.add_argument("--use-torch-compile", action="store_true", help="torch.compile each transformer layer")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="capture the whole training iteration in one CUDA graph and replay it (one GPU)")
    g.add_argument("--cuda-graph-scope", default="full_iteration", choices=["full_iteration"],
                   help="what the CUDA graph covers (only the whole iteration)")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="eager iterations before the capture")
    g.add_argument("--no-bias-gelu-fusion", action="store_true")
    g.add_argument("--no-bias-dropout-fusion", action="store_true")
    g.add_argument("--no-persist-layer-norm", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", action="store_true", help="use the unfused attention path")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_true",
                   help="write weight gradients to .grad and add them to the fp32 buffer afterwards")


def _reject_unsupported(argv: List[str]) -> None:
    for i, tok in enumerate(argv):
        flag = tok.split("=", 1)[0]
        if flag in UNSUPPORTED_MEGATRON_FLAGS:
            raise ValueError(f"{flag} is a Megatron-LM flag this framework does not support "
                             f"({UNSUPPORTED_MEGATRON_FLAGS[flag]})")
        if flag in UNSUPPORTED_CHOICES:
            value = tok.split("=", 1)[1] if "=" in tok else (argv[i + 1] if i + 1 < len(argv) else "")
            if value not in UNSUPPORTED_CHOICES[flag]:
                raise ValueError(f"{flag} {value} is not supported; supported: "
                                 f"{', '.join(UNSUPPORTED_CHOICES[flag])}")


def _fail(msg: str):
    raise ValueError(msg)


def _check_cuda_graph_args(args: argparse.Namespace, world_size: int) -> None:
    """--enable-cuda-graph captures one whole iteration; reject what that capture cannot hold, by name."""
    if not torch.cuda.is_available():
        _fail("--enable-cuda-graph needs a CUDA GPU")
    if world_size != 1:
        _fail(f"--enable-cuda-graph runs on one GPU (world size 1), got world size {world_size}")
    if args.fp16:
        _fail("--enable-cuda-graph needs --bf16 or fp32 (fp16 loss scaling reads overflow flags on the host)")
    if args.use_distributed_optimizer:
        _fail("--enable-cuda-graph does not combine with --use-distributed-optimizer (one GPU has nothing to shard)")
    if args.optimizer != "adam":
        _fail("--enable-cuda-graph needs --optimizer adam (the captured step is torch's fused AdamW)")
    if args.attention_dropout > 0.0:
        _fail("--enable-cuda-graph needs --attention-dropout 0 (the attention dropout generator is switched "
              "on the host)")
    if args.recompute_granularity == "full" or (args.recompute_granularity == "selective"
                                                and "core_attn" in args.recompute_modules):
        _fail("--enable-cuda-graph cannot capture recomputation that restores RNG states: use no recomputation "
              "or --recompute-granularity selective --recompute-modules mlp_act")
    if args.cuda_graph_warmup_steps < 1:
        _fail(f"--cuda-graph-warmup-steps must be >= 1, got {args.cuda_graph_warmup_steps}")


def _check_fp8_args(args: argparse.Namespace, tp: int) -> None:
    """--fp8-format: bf16 master run, eager layers, and GEMM sizes cuBLAS FP8 accepts (multiples of 16)."""
    if not args.bf16:
        _fail("--fp8-format needs --bf16 (FP8 GEMMs inside a bf16 model)")
    if args.use_torch_compile:
        _fail("--fp8-format does not combine with --use-torch-compile")
    if args.fp8_margin < 0:
        _fail(f"--fp8-margin must be >= 0, got {args.fp8_margin}")
    if args.fp8_amax_history_len < 1:
        _fail(f"--fp8-amax-history-len must be >= 1, got {args.fp8_amax_history_len}")
    if args.fp8_recipe != "delayed" and (args.fp8_amax_history_len != 1 or args.fp8_amax_compute_algo != "most_recent"):
        _fail("--fp8-amax-history-len and --fp8-amax-compute-algo need --fp8-recipe delayed")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        _fail(f"--fp8-format needs an FP8 GPU (compute capability 8.9 or newer), this one is {major}.{minor}")
    seq = args.seq_length // tp if args.sequence_parallel else args.seq_length
    sizes = {"--micro-batch-size x --seq-length" + (" / tp" if args.sequence_parallel else ""):
             args.micro_batch_size * seq, "--hidden-size / tp": args.hidden_size // tp,
             "--ffn-hidden-size / tp": args.ffn_hidden_size // tp, "--hidden-size": args.hidden_size}
    bad = [f"{name} = {v}" for name, v in sizes.items() if v % 16]
    if bad:
        _fail(f"--fp8-format needs GEMM sizes that are multiples of 16: {', '.join(bad)}")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check consistency and fill derived values; raise ``ValueError`` naming the flag and the numbers."""
    from megatron.core.parallel_state import validate_parallel_sizes

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.virtual_pipeline_model_parallel_size is not None:
            _fail("give only one of --num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size")
        per_stage = args.num_layers // pp
        if args.num_layers % pp or per_stage % args.num_layers_per_virtual_pipeline_stage:
            _fail(f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) must be divisible by "
                  f"--num-layers-per-virtual-pipeline-stage ({args.num_layers_per_virtual_pipeline_stage})")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    args.data_parallel_size = validate_parallel_sizes(world_size, tp, pp, args.virtual_pipeline_model_parallel_size)
    args.world_size = world_size
    dp = args.data_parallel_size

    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_attention_heads % tp:
        _fail(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
              f"--tensor-model-parallel-size ({tp})")
    if args.hidden_size % args.num_attention_heads:
        _fail(f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
              f"({args.num_attention_heads})")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.ffn_hidden_size % tp:
        _fail(f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by --tensor-model-parallel-size ({tp})")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        _fail(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings ({args.max_position_embeddings})")
    if args.sequence_parallel and args.seq_length % tp:
        _fail(f"--seq-length ({args.seq_length}) must be divisible by --tensor-model-parallel-size ({tp}) "
              "under --sequence-parallel")
    if args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None:
        chunks = pp * (args.virtual_pipeline_model_parallel_size or 1)
        if args.num_layers % chunks:
            _fail(f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) "
                  f"x virtual stages ({args.virtual_pipeline_model_parallel_size or 1}) = {chunks}")

    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        _fail(f"--global-batch-size ({args.global_batch_size}) must be a multiple of --micro-batch-size "
              f"({args.micro_batch_size}) x data-parallel size ({dp}) = {args.micro_batch_size * dp}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp and args.num_microbatches % pp:
        _fail(f"interleaved pipelining needs the number of microbatches ({args.num_microbatches} = "
              f"--global-batch-size / (--micro-batch-size x DP)) to be a multiple of "
              f"--pipeline-model-parallel-size ({pp})")

    if (args.train_iters is None) == (args.train_samples is None) and not args.skip_train:
        _fail("give exactly one of --train-iters and --train-samples")
    if args.train_samples is not None:
        if args.train_samples < args.global_batch_size:
            _fail(f"--train-samples ({args.train_samples}) is smaller than --global-batch-size "
                  f"({args.global_batch_size})")
        args.train_iters = args.train_samples // args.global_batch_size
    if args.train_iters is None:
        args.train_iters = 0
    if args.lr is None:
        _fail("--lr is required")
    if args.min_lr > args.lr:
        _fail(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        _fail("give only one of --lr-warmup-iters and --lr-warmup-fraction")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            _fail(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters > max(args.lr_decay_iters, 0) and args.lr_decay_style != "constant":
        _fail(f"--lr-warmup-iters ({args.lr_warmup_iters}) exceeds --lr-decay-iters ({args.lr_decay_iters})")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            _fail(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if args.bf16 and args.fp16:
        _fail("give only one of --bf16 and --fp16")
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            _fail("--recompute-activations means --recompute-granularity selective")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full" and args.recompute_method is None:
        _fail("--recompute-granularity full needs --recompute-method uniform or block")
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    for name in ("log_interval", "eval_interval", "make_vocab_size_divisible_by"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_iters < 0:
        _fail(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.save_interval is not None and args.save_interval < 1:
        _fail(f"--save-interval must be >= 1, got {args.save_interval}")
    if args.save_interval is not None and args.save is None:
        _fail("--save-interval needs --save")
    if not args.data_path:
        _fail("--data-path is required (a preprocessed prefix, or weights and prefixes)")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        _fail("--overlap-param-gather needs --use-distributed-optimizer")
    if args.enable_cuda_graph:
        _check_cuda_graph_args(args, world_size)
    if args.fp8_format is not None:
        _check_fp8_args(args, tp)
    args.params_dtype = "bfloat16" if args.bf16 else ("float16" if args.fp16 else "float32")
    if args.no_masked_softmax_fusion:
        args.attention_backend = "unfused"
    args.attention_backend = {"auto": "sdpa", "flash": "flash", "fused": "cudnn", "unfused": "unfused",
                              "local": "unfused"}[args.attention_backend]
    return args


def parse_args(argv: Optional[List[str]] = None, world_size: int = 1) -> argparse.Namespace:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="Megatron-style GPT pretraining", allow_abbrev=False)
    _add_arguments(parser)
    try:
        _reject_unsupported(argv)
    except ValueError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    try:
        return validate_args(args, world_size)
    except ValueError as exc:
        parser.error(str(exc))


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` at or above ``vocab_size`` (Megatron's padding)."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def params_dtype(args) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.params_dtype]


def args_to_plain_dict(args: argparse.Namespace) -> dict:
    """The arguments as plain Python types, safe for ``torch.load(weights_only=True)``."""
    out = {}
    for k, v in vars(args).items():
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)):
            out[k] = [x if isinstance(x, (bool, int, float, str)) else str(x) for x in v]
        else:
            out[k] = str(v)
    return out
