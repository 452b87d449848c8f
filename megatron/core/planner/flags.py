"""Megatron flag names -> planner inputs: shared by ``tools/plan.py`` and the entry points' ``--dry-run``.

``add_model_arguments`` / ``add_layout_arguments`` / ``add_cluster_arguments`` declare the flags (same names
and defaults as the trainer's), ``inputs_from_args`` builds ``(ModelShape, Layout or None, Cluster, global
batch)`` from the parsed namespace, and ``inputs_from_argv`` does both for a trainer command line (unknown
flags are ignored, so a full ``pretrain_gpt.py`` command line can be handed over as it is).
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Tuple

from megatron.core.planner.shapes import Cluster, Layout, ModelShape
from megatron.core.planner.timing import calibrated_gpu_memory_gb, load_calibration

GPT2_VOCAB = 50257
BERT_VOCAB = 30522


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model shape (the trainer's flags)")
    g.add_argument("--model", choices=["gpt", "bert"], default="gpt", help="GPT (pretrain_gpt.py, the default) or BERT "
                   "(pretrain_bert.py: token-type embeddings, the LM-head transform, pooler and binary head, "
                   "bidirectional attention with a padding mask)")
    g.add_argument("--num-layers", type=int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=int, required=True, help="hidden size h")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP inner size (default 4h)")
    g.add_argument("--num-attention-heads", type=int, required=True, help="attention heads a")
    g.add_argument("--seq-length", type=int, required=True, help="sequence length s")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="rows of the learned position table (default --seq-length)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help=f"tokenizer vocabulary before padding (default {GPT2_VOCAB} for GPT-2 BPE, {BERT_VOCAB} "
                        "for BERT WordPiece)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="the vocabulary is padded to a multiple of this x TP (Megatron's padding; default 128)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output-layer weight (another V x h matrix on the last stage)")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute",
                   help="learned_absolute keeps a [max positions, h] table; rope keeps none")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="attention dropout (default 0.1; flash attention keeps no mask: matters for "
                        "--attention-backend unfused only)")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="hidden dropout (default 0.1; > 0 keeps two masks per layer)")
    g.add_argument("--bert-no-binary-head", action="store_true",
                   help="BERT without the pooler, binary head and token-type embeddings")
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="BERT: fraction of positions masked (default 0.15); the masked-LM head projects "
                        "floor(mask-prob x seq-length) positions per sample onto the vocabulary")
    g.add_argument("--global-batch-size", type=int, required=True, help="sequences per iteration")


def add_layout_arguments(p: argparse.ArgumentParser, for_search: bool) -> None:
    """The layout flags; in a search (tools/plan.py) each left unset is enumerated instead of fixed."""
    g = p.add_argument_group("layout (fixed when given" + (", searched when not)" if for_search else ")"))
    d = None if for_search else 1
    g.add_argument("--tensor-model-parallel-size", type=int, default=d, help="TP size")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=d, help="PP size")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved 1F1B)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None, help="layers on the first stage")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None, help="layers on the last stage")
    g.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism (with TP > 1)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard fp32 main params and Adam moments over DP")
    g.add_argument("--recompute-granularity", choices=["selective", "full"], default=None,
                   help="selective: recompute the attention core and/or GeLU; full: keep only layer inputs")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recomputation: uniform groups of --recompute-num-layers, or the first N layers (block)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per group (uniform) or recomputed layers per stage (block, selective)")
    g.add_argument("--recompute-modules", nargs="*", default=["core_attn", "mlp_act"],
                   help="what selective recomputation covers: core_attn and/or mlp_act (default both)")
    g.add_argument("--micro-batch-size", type=int, default=d,
                   help="sequences per microbatch (tools/plan.py: searched over --micro-batch-sizes when not given)")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    g.add_argument("--fp16", action="store_true", help="fp16 parameters and activations")
    g.add_argument("--fp8-format", default=None,
                   help="FP8 GEMMs in the transformer layers (e4m3 or hybrid; implies bf16 elsewhere)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: one bucket per model chunk)")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="overlap the DP reduction with backward")
    g.add_argument("--overlap-param-gather", action="store_true", help="overlap the param all-gather with forward")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fused vocabulary cross-entropy (TP 1: no fp32 copy of the logits)")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="adam (default) keeps two fp32 moments per parameter, sgd one momentum")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="replay each iteration from a CUDA graph (1 GPU): the host's launch work is not paid")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="unfused bias-dropout-add: PyTorch's dropout keeps two 1-byte masks per layer (the fused "
                        "kernel regenerates them)")
    g.add_argument("--attention-backend", default="sdpa", choices=["sdpa", "flash", "cudnn", "unfused", "auto"],
                   help="sdpa (default), flash, cudnn and auto keep no s x s scores; unfused keeps them")


def add_cluster_arguments(p: argparse.ArgumentParser, num_gpus_required: bool) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--num-gpus", type=int, required=num_gpus_required, default=None if num_gpus_required else 1,
                   help="GPUs in the job (= TP x PP x DP)")
    g.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node (default 8; collectives beyond it cross nodes)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory per GPU in GB (1e9 bytes) as CUDA reports it (default: the calibration's, measured "
                        "by --calibrate; H200: 150.11 = 139.8 GiB)")
    g.add_argument("--gpu-kind", default="h200",
                   help="calibration of the time model: a shipped kind (default h200) or a JSON file from --calibrate")


def model_shape(args: argparse.Namespace) -> ModelShape:
    vocab = args.vocab_size or (BERT_VOCAB if args.model == "bert" else GPT2_VOCAB)
    return ModelShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length, model=args.model,
                      ffn_hidden_size=args.ffn_hidden_size, max_position_embeddings=args.max_position_embeddings,
                      vocab_size=vocab, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                      position_embedding_type=args.position_embedding_type,
                      attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
                      bert_binary_head=not args.bert_no_binary_head,
                      num_tokentypes=0 if args.bert_no_binary_head else 2, mask_prob=args.mask_prob)


def precision_of(args: argparse.Namespace) -> str:
    if args.fp8_format:
        return "fp8"
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def layout_switches(args: argparse.Namespace) -> dict:
    """The Layout fields that are flags rather than searched dimensions."""
    return dict(first_stage_layers=args.decoder_first_pipeline_num_layers,
                last_stage_layers=args.decoder_last_pipeline_num_layers, ddp_bucket_size=args.ddp_bucket_size,
                overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
                cross_entropy_fusion=args.cross_entropy_loss_fusion, optimizer=args.optimizer,
                recompute_modules=tuple(args.recompute_modules), cuda_graph=args.enable_cuda_graph,
                bias_dropout_fusion=args.bias_dropout_fusion,
                attention_backend="sdpa" if args.attention_backend in ("auto", "flash", "cudnn") else
                args.attention_backend)


def layout_from_args(args: argparse.Namespace, num_gpus: int) -> Layout:
    tp, pp = args.tensor_model_parallel_size or 1, args.pipeline_model_parallel_size or 1
    if num_gpus % (tp * pp):
        raise ValueError(f"--num-gpus {num_gpus} is not divisible by TP x PP = {tp} x {pp}")
    return Layout(tp=tp, pp=pp, dp=num_gpus // (tp * pp), vpp=args.virtual_pipeline_model_parallel_size,
                  sp=args.sequence_parallel, distributed_optimizer=args.use_distributed_optimizer,
                  recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                  recompute_num_layers=args.recompute_num_layers, micro_batch_size=args.micro_batch_size or 1,
                  precision=precision_of(args), **layout_switches(args))


def cluster_from_args(args: argparse.Namespace, calibration: dict) -> Cluster:
    memory = args.gpu_memory_gb if args.gpu_memory_gb is not None else calibrated_gpu_memory_gb(calibration)
    return Cluster(num_gpus=args.num_gpus, gpu_memory_gb=memory, gpus_per_node=args.gpus_per_node,
                   gpu_kind=args.gpu_kind)


def inputs_from_argv(argv: List[str], num_gpus: int, gpu_memory_gb: Optional[float] = None, gpus_per_node: int = 8,
                     gpu_kind: str = "h200") -> Tuple[ModelShape, Layout, Cluster, int]:
    """Planner inputs for a trainer command line run on ``num_gpus`` GPUs (unknown flags ignored); the memory per
    GPU defaults to the ``gpu_kind`` calibration's (``timing.calibrated_gpu_memory_gb``)."""
    if gpu_memory_gb is None:
        gpu_memory_gb = calibrated_gpu_memory_gb(load_calibration(gpu_kind))
    p = argparse.ArgumentParser(add_help=False)
    add_model_arguments(p)
    add_layout_arguments(p, for_search=False)
    args, _ = p.parse_known_args(argv)
    if args.model == "gpt" and any(a.startswith("--bert") or a == "--binary-head" for a in argv):
        args.model = "bert"
    cluster = Cluster(num_gpus=num_gpus, gpu_memory_gb=gpu_memory_gb, gpus_per_node=gpus_per_node, gpu_kind=gpu_kind)
    return model_shape(args), layout_from_args(args, num_gpus), cluster, args.global_batch_size


def planner_argv(trainer: argparse.Namespace, vocab_size: Optional[int] = None) -> List[str]:
    """The planner's flags for a validated trainer namespace (the trainer's attribute names, after validation:
    older spellings rewritten, ``--recompute-activations`` resolved, the attention backend a kernel name)."""
    t = trainer
    argv: List[str] = []

    def add(flag: str, value) -> None:
        if value is not None:
            argv.extend([flag, str(value)])

    for flag, name in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--ffn-hidden-size", "ffn_hidden_size"), ("--num-attention-heads", "num_attention_heads"),
                       ("--seq-length", "seq_length"), ("--max-position-embeddings", "max_position_embeddings"),
                       ("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by"),
                       ("--attention-dropout", "attention_dropout"), ("--hidden-dropout", "hidden_dropout"),
                       ("--global-batch-size", "global_batch_size"), ("--micro-batch-size", "micro_batch_size"),
                       ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                       ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
                       ("--virtual-pipeline-model-parallel-size", "virtual_pipeline_model_parallel_size"),
                       ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
                       ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
                       ("--recompute-granularity", "recompute_granularity"),
                       ("--recompute-method", "recompute_method"),
                       ("--recompute-num-layers", "recompute_num_layers"), ("--fp8-format", "fp8_format"),
                       ("--ddp-bucket-size", "ddp_bucket_size"), ("--optimizer", "optimizer"),
                       ("--attention-backend", "attention_backend"),
                       ("--position-embedding-type", "position_embedding_type"), ("--mask-prob", "mask_prob")):
        add(flag, getattr(t, name, None))
    add("--vocab-size", vocab_size)
    if getattr(t, "recompute_modules", None):
        argv += ["--recompute-modules", *t.recompute_modules]
    for flag, name in (("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights"),
                       ("--sequence-parallel", "sequence_parallel"),
                       ("--use-distributed-optimizer", "use_distributed_optimizer"), ("--bf16", "bf16"),
                       ("--fp16", "fp16"), ("--overlap-grad-reduce", "overlap_grad_reduce"),
                       ("--overlap-param-gather", "overlap_param_gather"),
                       ("--cross-entropy-loss-fusion", "cross_entropy_loss_fusion"),
                       ("--enable-cuda-graph", "enable_cuda_graph")):
        if getattr(t, name, False):
            argv.append(flag)
    if not getattr(t, "bias_dropout_fusion", True):
        argv.append("--no-bias-dropout-fusion")
    return argv
