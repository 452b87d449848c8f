"""The planner's inputs from the trainer's own flags and configuration.

``--dry-run`` hands its validated namespace to :func:`inputs_from_namespace`; ``tools/plan.py`` and the plan
validation read a command line with the trainer's parser (:func:`planner_parser`: every trainer flag, the BERT
section, and only the planner's own cluster flags added), fill the model-shape defaults as the trainer does, and
call the same function. The model becomes a :class:`~megatron.core.planner.shapes.ModelShape` through the
trainer's one mapping from flags to the model description (``ModelConfig.spec``, ``spec_from_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import List, Optional, Sequence, Tuple

from megatron.core.model_spec import spec_from_args
from megatron.core.planner.shapes import Cluster, Layout, ModelShape
from megatron.core.planner.timing import calibrated_gpu_memory_gb, load_calibration
from megatron.training.arguments import ATTENTION_BACKENDS, CHECKPOINT_ARGS, make_parser
from megatron.training.bert_section import BERT
from megatron.training.flag_table import rewrite_argv

GPT2_VOCAB = 50257
BERT_VOCAB = 30522


def add_planner_arguments(p: argparse.ArgumentParser, num_gpus_required: bool) -> None:
    """The planner's own flags: which entry point's model, and the cluster."""
    g = p.add_argument_group("planner: model kind and cluster")
    g.add_argument("--model", choices=["gpt", "bert"], default="gpt", help="GPT (pretrain_gpt.py, the default) or BERT "
                   "(pretrain_bert.py: token-type embeddings, the LM-head transform, pooler and binary head, "
                   "bidirectional attention with a padding mask)")
    g.add_argument("--num-gpus", type=int, required=num_gpus_required, default=None if num_gpus_required else 1,
                   help="GPUs in the job (= TP x PP x DP)")
    g.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node (default 8; collectives beyond it cross nodes)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory per GPU in GB (1e9 bytes) as CUDA reports it (default: the calibration's, measured "
                        "by --calibrate; H200: 150.11 = 139.8 GiB)")
    g.add_argument("--gpu-kind", default="h200",
                   help="calibration of the time model: a shipped kind (default h200) or a JSON file from --calibrate")


def planner_parser(search: bool = False, parser_extension=None, **parser_kwargs) -> argparse.ArgumentParser:
    """The trainer's parser (with the BERT section) plus the planner's flags. ``search``: the tensor- and
    pipeline-parallel sizes default to unset (``tools/plan.py`` searches them, and micro-batch sizes);
    ``parser_extension(parser)`` adds a tool's own flags."""
    p = make_parser((BERT,), **parser_kwargs)
    add_planner_arguments(p, num_gpus_required=search)
    if parser_extension is not None:
        parser_extension(p)
    if search:
        p.set_defaults(tensor_model_parallel_size=None, pipeline_model_parallel_size=None)
    return p


def parse_planner_argv(argv: Sequence[str], search: bool = False, parser_extension=None,
                       **parser_kwargs) -> argparse.Namespace:
    """A trainer command line read as the trainer reads it (older spellings rewritten, refused flags refused),
    without the checks a training run needs (no --lr, data or iterations required); the model-shape defaults
    filled as the trainer fills them."""
    parser = planner_parser(search, parser_extension, **parser_kwargs)
    argv, _ = rewrite_argv(list(argv), parser.known_flags())
    ns = parser.parse_args(argv)
    for name, default in CHECKPOINT_ARGS.items():
        if getattr(ns, name) is None:
            setattr(ns, name, default)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(ns, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required")
    if ns.recompute_activations and ns.recompute_granularity is None:
        ns.recompute_granularity = "selective"
    if ns.no_masked_softmax_fusion:
        ns.attention_backend = "unfused"
    ns.attention_backend = ATTENTION_BACKENDS[ns.attention_backend]
    return ns


def model_shape(ns: argparse.Namespace, model: str = "gpt", vocab_size: Optional[int] = None) -> ModelShape:
    """The planner's model for the trainer's flags ``ns`` (validated or read by :func:`parse_planner_argv`);
    ``vocab_size``: the tokenizer's (default: the flags' ``--vocab-size``, as NullTokenizer counts it with
    ``--tokenizer-type NullTokenizer``, else GPT-2's or BERT's)."""
    bert = model == "bert"
    flag_vocab = getattr(ns, "vocab_size", None)
    if vocab_size is None and flag_vocab and getattr(ns, "tokenizer_type", None) == "NullTokenizer":
        from megatron.core.tokenizer import build_tokenizer

        vocab_size = build_tokenizer("NullTokenizer", vocab_size=flag_vocab).vocab_size  # its end-of-document id
    vocab = vocab_size or flag_vocab or (BERT_VOCAB if bert else GPT2_VOCAB)
    binary = bool(getattr(ns, "bert_binary_head", True))
    spec = spec_from_args(vars(ns))
    return ModelShape(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}, model=model,
                      vocab_size=vocab, make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
                      attention_dropout=ns.attention_dropout, hidden_dropout=ns.hidden_dropout,
                      bert_binary_head=binary, num_tokentypes=2 if binary else 0,
                      mask_prob=getattr(ns, "mask_prob", 0.15))


def precision_of(ns: argparse.Namespace) -> str:
    if ns.fp8_format:
        return "fp8"
    return "bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32"


def layout_switches(ns: argparse.Namespace) -> dict:
    """The Layout fields that are flags rather than searched dimensions."""
    return dict(first_stage_layers=ns.decoder_first_pipeline_num_layers,
                last_stage_layers=ns.decoder_last_pipeline_num_layers, ddp_bucket_size=ns.ddp_bucket_size,
                overlap_grad_reduce=ns.overlap_grad_reduce, overlap_param_gather=ns.overlap_param_gather,
                cross_entropy_fusion=ns.cross_entropy_loss_fusion, optimizer=ns.optimizer,
                recompute_modules=tuple(ns.recompute_modules), cuda_graph=ns.enable_cuda_graph,
                bias_dropout_fusion=ns.bias_dropout_fusion, attention_backend="unfused" if ns.attention_backend == "unfused" else "sdpa")


def layout_from_args(ns: argparse.Namespace, num_gpus: int) -> Layout:
    tp, pp = ns.tensor_model_parallel_size or 1, ns.pipeline_model_parallel_size or 1
    if num_gpus % (tp * pp):
        raise ValueError(f"--num-gpus {num_gpus} is not divisible by TP x PP = {tp} x {pp}")
    recompute_num_layers = ns.recompute_num_layers
    if ns.recompute_granularity == "full" and recompute_num_layers is None and ns.recompute_method is not None:
        recompute_num_layers = 1
    return Layout(tp=tp, pp=pp, dp=num_gpus // (tp * pp), vpp=ns.virtual_pipeline_model_parallel_size,
                  sp=ns.sequence_parallel, distributed_optimizer=ns.use_distributed_optimizer,
                  recompute_granularity=ns.recompute_granularity, recompute_method=ns.recompute_method,
                  recompute_num_layers=recompute_num_layers, micro_batch_size=ns.micro_batch_size or 1,
                  precision=precision_of(ns), **layout_switches(ns))


def cluster_from_args(ns: argparse.Namespace, calibration: dict) -> Cluster:
    memory = ns.gpu_memory_gb if ns.gpu_memory_gb is not None else calibrated_gpu_memory_gb(calibration)
    return Cluster(num_gpus=ns.num_gpus, gpu_memory_gb=memory, gpus_per_node=ns.gpus_per_node, gpu_kind=ns.gpu_kind)


def inputs_from_namespace(ns: argparse.Namespace, num_gpus: int, model: str = "gpt",
                          vocab_size: Optional[int] = None, gpu_memory_gb: Optional[float] = None,
                          gpus_per_node: int = 8, gpu_kind: str = "h200") -> Tuple[ModelShape, Layout, Cluster, int]:
    """``(ModelShape, Layout, Cluster, global batch)`` of the trainer's flags ``ns`` run on ``num_gpus`` GPUs; the
    memory per GPU defaults to the ``gpu_kind`` calibration's (``timing.calibrated_gpu_memory_gb``)."""
    if gpu_memory_gb is None:
        gpu_memory_gb = calibrated_gpu_memory_gb(load_calibration(gpu_kind))
    cluster = Cluster(num_gpus=num_gpus, gpu_memory_gb=gpu_memory_gb, gpus_per_node=gpus_per_node, gpu_kind=gpu_kind)
    gbs = ns.global_batch_size
    if gbs is None:
        raise ValueError("--global-batch-size is required")
    return model_shape(ns, model, vocab_size), layout_from_args(ns, num_gpus), cluster, gbs


def inputs_from_argv(argv: Sequence[str], num_gpus: int, **cluster) -> Tuple[ModelShape, Layout, Cluster, int]:
    """Planner inputs for a trainer command line (``--model bert`` for pretrain_bert.py's) on ``num_gpus`` GPUs."""
    ns = parse_planner_argv(argv)
    return inputs_from_namespace(ns, num_gpus, model=ns.model, **cluster)


__all__: List[str] = ["add_planner_arguments", "planner_parser", "parse_planner_argv", "model_shape", "precision_of",
                      "layout_switches", "layout_from_args", "cluster_from_args", "inputs_from_namespace",
                      "inputs_from_argv", "GPT2_VOCAB", "BERT_VOCAB"]
