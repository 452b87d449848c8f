"""What the planner reasons about: a model shape, a parallel layout, a cluster, and the parameters of a stage.

The model is a ``ModelSpec`` (``megatron/core/model_spec.py``) with the planner's extras; the layout fields are
named after the Megatron flags they stand for. The parameter enumeration (:func:`chunk_param_numels`, from
``megatron.core.model_counts``) lists the parameters one pipeline chunk registers, in registration order, as the
models of ``megatron/core/models`` build them: the distributed-data-parallel buffer layout (and so the exact
padding of the distributed optimizer) follows from that order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron.core import model_counts
from megatron.core.model_spec import ModelSpec

PRECISIONS = ("bf16", "fp8", "fp16", "fp32")
RECOMPUTE = (None, "selective", "full")


@dataclass(frozen=True)
class ModelShape(ModelSpec):
    """The model (every ``ModelSpec`` field: sizes, query groups, norm, position embedding, MLP, biases, tied or
    untied output) plus what the planner needs besides.

    model: ``gpt`` or ``bert`` (BERT adds token-type embeddings, the LM-head transform with its output bias, and
    with ``bert_binary_head`` the pooler and binary head; ``--bert-no-binary-head`` also drops the token types; its
    attention is bidirectional). vocab_size: the tokenizer's, padded to a multiple of make_vocab_size_divisible_by
    x TP for each layout (``padded_vocab``; ``padded_vocab_size`` holds the padding at TP 1). attention_dropout,
    hidden_dropout, and for BERT mask_prob (the masked-LM head projects ``lm_positions`` positions per sample).
    """

    model: str = "gpt"
    vocab_size: int = 50257
    make_vocab_size_divisible_by: int = 128
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    num_tokentypes: int = 2  # BERT only
    bert_binary_head: bool = True  # BERT only: the pooler and the 2-way sentence-order head
    mask_prob: float = 0.15  # BERT only: fixes how many positions per sample reach the vocabulary (lm_positions)

    def __post_init__(self):
        for name in ("vocab_size", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.model not in ("gpt", "bert"):
            raise ValueError(f"--model must be gpt or bert, got {self.model!r}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.mask_prob}")
        if self.model == "bert":
            object.__setattr__(self, "attention_mask_type", "padding")
        object.__setattr__(self, "padded_vocab_size", self.padded_vocab(1))
        super().__post_init__()

    @property
    def lm_positions(self) -> int:
        """Positions per sample projected onto the vocabulary: every one for GPT; for BERT the static count the
        masked-LM head selects, ``floor(mask_prob x seq_length)`` (at least 1), the most a sample masks."""
        if self.model != "bert":
            return self.seq_length
        return max(1, min(self.seq_length, math.floor(self.mask_prob * self.seq_length)))

    @property
    def tied(self) -> bool:
        return self.share_embeddings_and_output_weights

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp`` (Megatron's padding)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return (self.vocab_size + multiple - 1) // multiple * multiple

    def spec_at(self, tp: int) -> ModelSpec:
        """The model's spec with the vocabulary padded for ``tp`` tensor-parallel ranks."""
        return dataclasses.replace(self.spec, padded_vocab_size=self.padded_vocab(tp))


@dataclass(frozen=True)
class Layout:
    """One parallel layout and the memory/time switches that go with it (Megatron flag names).

    tp/pp/dp: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, the data-parallel size
    (world / (tp * pp)); vpp: ``--virtual-pipeline-model-parallel-size``; sp: ``--sequence-parallel``;
    distributed_optimizer: ``--use-distributed-optimizer``; recompute_*: ``--recompute-granularity``,
    ``--recompute-method``, ``--recompute-num-layers``, ``--recompute-modules``; micro_batch_size:
    ``--micro-batch-size``; precision: bf16 (``--bf16``), fp8 (``--bf16 --fp8-format hybrid``), fp16, fp32;
    first/last_stage_layers: ``--decoder-first/last-pipeline-num-layers``; ddp_bucket_size: ``--ddp-bucket-size``;
    overlap_grad_reduce / overlap_param_gather: the ``--overlap-*`` flags; cross_entropy_fusion:
    ``--cross-entropy-loss-fusion``; optimizer: ``--optimizer`` (adam or sgd); cuda_graph: ``--enable-cuda-graph``
    (the iteration replayed from a CUDA graph: no host floor in the time model); bias_dropout_fusion: off with
    ``--no-bias-dropout-fusion`` (PyTorch's dropout then keeps a 1-byte mask per element; the fused kernel none).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: Optional[int] = None
    sp: bool = False
    distributed_optimizer: bool = False
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Tuple[str, ...] = ("core_attn", "mlp_act")
    micro_batch_size: int = 1
    precision: str = "bf16"
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    ddp_bucket_size: Optional[int] = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    cross_entropy_fusion: bool = True
    optimizer: str = "adam"
    attention_backend: str = "sdpa"
    cuda_graph: bool = False
    bias_dropout_fusion: bool = True

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.recompute_granularity not in RECOMPUTE:
            raise ValueError(f"--recompute-granularity must be selective or full, got {self.recompute_granularity}")
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
        if self.sp and self.tp == 1:
            object.__setattr__(self, "sp", False)  # sequence parallelism is a no-op without TP
        if self.vpp == 1:
            object.__setattr__(self, "vpp", None)

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp:
            parts.append(f"VP{self.vpp}")
        parts.append(f"DP{self.dp}")
        if self.sp:
            parts.append("SP")
        if self.distributed_optimizer:
            parts.append("distopt")
        return " ".join(parts)

    def recompute_label(self) -> str:
        if self.recompute_granularity is None:
            return "none"
        if self.recompute_granularity == "selective":
            label = "sel"
            if tuple(self.recompute_modules) != ("core_attn", "mlp_act"):
                label += "(" + "+".join(self.recompute_modules) + ")"
        else:
            label = f"full/{self.recompute_method}"
        if self.recompute_num_layers:
            label += f"/{self.recompute_num_layers}"
        return label


@dataclass(frozen=True)
class Cluster:
    """``num_gpus`` in all, ``gpus_per_node`` per node, ``gpu_memory_gb`` (GB = 1e9 bytes, as vendors quote)."""

    num_gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8
    gpu_kind: str = "h200"

    def __post_init__(self):
        if self.num_gpus < 1:
            raise ValueError(f"--num-gpus must be >= 1, got {self.num_gpus}")
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.gpu_memory_gb <= 0:
            raise ValueError(f"--gpu-memory-gb must be positive, got {self.gpu_memory_gb}")

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gb * 1e9


@dataclass(frozen=True)
class Chunk:
    """One model chunk of a pipeline rank: ``num_layers`` decoder layers, embedding (pre) and/or head (post)."""

    num_layers: int
    pre: bool
    post: bool


def stage_chunks(shape: ModelShape, layout: Layout, pp_rank: int) -> Tuple[Chunk, ...]:
    """The chunks pipeline rank ``pp_rank`` builds (``megatron/core/pipeline_parallel/partition.py`` split)."""
    return _stage_chunks(shape.num_layers, layout.pp, layout.vpp, layout.first_stage_layers, layout.last_stage_layers,
                         pp_rank)


@functools.lru_cache(maxsize=4096)
def _stage_chunks(num_layers: int, pp: int, vpp: Optional[int], first: Optional[int], last: Optional[int],
                  pp_rank: int) -> Tuple[Chunk, ...]:
    from megatron.core.pipeline_parallel.partition import layers_for_stage

    chunks = vpp or 1
    out = []
    for v in range(chunks):
        _, count = layers_for_stage(num_layers, pp, pp_rank, vpp_size=vpp, vpp_rank=v, first_stage_layers=first,
                                    last_stage_layers=last)
        out.append(Chunk(count, pre=pp_rank == 0 and v == 0, post=pp_rank == pp - 1 and v == chunks - 1))
    return tuple(out)


def chunk_param_numels(shape: ModelShape, tp: int, chunk: Chunk) -> List[int]:
    """Element counts of the trainable parameters of one chunk on one TP rank, in registration order
    (``megatron.core.model_counts``)."""
    return model_counts.chunk_param_numels(shape.spec_at(tp), tp, chunk.num_layers, chunk.pre, chunk.post,
                                           family=shape.model, num_tokentypes=shape.num_tokentypes,
                                           bert_binary_head=shape.bert_binary_head)


def check_layout(shape: ModelShape, layout: Layout, global_batch_size: int) -> None:
    """Raise ``ValueError`` naming the flag when the layout cannot run this shape and batch."""
    shape.check_tensor_parallel(layout.tp)
    if layout.sp and shape.seq_length % layout.tp:
        raise ValueError(f"--seq-length ({shape.seq_length}) is not divisible by --tensor-model-parallel-size "
                         f"({layout.tp}) under --sequence-parallel")
    for r in range(layout.pp):
        stage_chunks(shape, layout, r)  # raises on a bad layer split
    if layout.vpp and layout.pp == 1:
        raise ValueError("--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1")
    per_step = layout.micro_batch_size * layout.dp
    if global_batch_size % per_step:
        raise ValueError(f"--global-batch-size ({global_batch_size}) is not divisible by --micro-batch-size x DP "
                         f"({layout.micro_batch_size} x {layout.dp})")
    m = global_batch_size // per_step
    if layout.vpp and m % layout.pp:
        raise ValueError(f"interleaving needs the number of microbatches ({m}) to be a multiple of "
                         f"--pipeline-model-parallel-size ({layout.pp})")
