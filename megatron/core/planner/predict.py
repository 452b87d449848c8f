"""One prediction per layout, the search over layouts, and the text both ``tools/plan.py`` and ``--dry-run`` print.

Inputs in Megatron flag terms: the model shape (:class:`ModelShape`: ``--num-layers``, ``--hidden-size``,
``--ffn-hidden-size``, ``--num-attention-heads``, ``--seq-length``, ``--max-position-embeddings``, the
tokenizer's vocabulary with ``--make-vocab-size-divisible-by``, ``--untie-embeddings-and-output-weights``,
``--position-embedding-type``, ``--attention-dropout``, ``--hidden-dropout``), the layout (:class:`Layout`:
``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--virtual-pipeline-model-parallel-size``,
``--sequence-parallel``, ``--use-distributed-optimizer``, ``--recompute-*``, ``--micro-batch-size``, ``--bf16`` /
``--fp8-format``, ``--decoder-first/last-pipeline-num-layers``, ``--ddp-bucket-size``, ``--overlap-grad-reduce``,
``--cross-entropy-loss-fusion``), ``--global-batch-size``, and the cluster (:class:`Cluster`).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Iterable, List, Optional, Sequence

from megatron.core.planner.memory import StageMemory, buckets_of, owned_elements, stage_memory
from megatron.core.planner.shapes import Cluster, Layout, ModelShape, chunk_param_numels, check_layout, stage_chunks
from megatron.core.planner.timing import IterationTime, iteration_time, model_flops_per_iteration

GIB = 2 ** 30


@dataclass
class Prediction:
    layout: Layout
    global_batch_size: int
    num_microbatches: int
    stages: List[StageMemory]
    peak_bytes: float
    heaviest_stage: int
    memory_limit_bytes: float
    time: IterationTime
    tokens_per_s: float
    mfu: float
    mfu_peak_tflops: float
    mfu_peak_name: str
    calibration: str

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.memory_limit_bytes

    @property
    def required_bytes(self) -> float:
        return self.stages[self.heaviest_stage].required

    @property
    def ms_per_iter(self) -> float:
        return self.time.seconds * 1e3

    def to_dict(self) -> dict:
        heavy = self.stages[self.heaviest_stage]
        return {
            "layout": asdict(self.layout), "describe": self.layout.describe(),
            "recompute": self.layout.recompute_label(), "precision": self.layout.precision,
            "micro_batch_size": self.layout.micro_batch_size, "num_microbatches": self.num_microbatches,
            "global_batch_size": self.global_batch_size,
            "fits": self.fits, "peak_mem_gib": self.peak_bytes / GIB, "heaviest_stage": self.heaviest_stage,
            "memory_limit_gib": self.memory_limit_bytes / GIB, "required_mem_gib": self.required_bytes / GIB,
            "stage_peak_mem_gib": [st.total / GIB for st in self.stages],
            "params_per_rank": [st.params for st in self.stages],
            "heaviest_stage_bytes": {**heavy.state, "activations": heavy.activations, "transient": heavy.transient,
                                     "required": heavy.required},
            "ms_per_iter": self.ms_per_iter, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "mfu_peak_tflops": self.mfu_peak_tflops, "mfu_peak": self.mfu_peak_name,
            "time_ms": {"per_microbatch": self.time.per_microbatch * 1e3, "bubble": self.time.bubble * 1e3,
                        "pp_comm": self.time.pp_comm * 1e3, "dp_comm": self.time.dp_comm * 1e3,
                        "optimizer": self.time.optimizer * 1e3, "overhead": self.time.overhead * 1e3,
                        **{k: v * 1e3 for k, v in self.time.parts.items()}},
            "calibration": self.calibration,
        }


def _buffer_elements(shape: ModelShape, layout: Layout, pp_rank: int) -> int:
    total = 0
    for c in stage_chunks(shape, layout, pp_rank):
        numels = chunk_param_numels(shape, layout.tp, c)
        total += sum(p for _, p in buckets_of(list(reversed(numels)), layout.ddp_bucket_size, layout.dp,
                                              layout.distributed_optimizer))
    return total


def _stepped_elements(shape: ModelShape, layout: Layout, pp_rank: int) -> int:
    total = 0
    for c in stage_chunks(shape, layout, pp_rank):
        numels = chunk_param_numels(shape, layout.tp, c)
        if layout.distributed_optimizer:
            bks = buckets_of(list(reversed(numels)), layout.ddp_bucket_size, layout.dp, True)
            total += owned_elements(bks, layout.dp, 0)
        else:
            total += sum(numels)
    return total


def predict(shape: ModelShape, layout: Layout, cluster: Cluster, calibration: dict,
            global_batch_size: int) -> Prediction:
    """Peak memory of the heaviest pipeline stage, iteration time, tokens/s and MFU of one layout."""
    check_layout(shape, layout, global_batch_size)
    if layout.world != cluster.num_gpus:
        raise ValueError(f"TP x PP x DP = {layout.tp} x {layout.pp} x {layout.dp} = {layout.world} but --num-gpus "
                         f"is {cluster.num_gpus}")
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    stages = [stage_memory(shape, layout, m, calibration, r) for r in range(layout.pp)]
    heaviest = max(range(layout.pp), key=lambda r: stages[r].required)
    slow = max(range(layout.pp), key=lambda r: _stepped_elements(shape, layout, r))
    t = iteration_time(shape, layout, cluster, calibration, m, _stepped_elements(shape, layout, slow),
                       _buffer_elements(shape, layout, slow))
    tokens = global_batch_size * shape.seq_length / t.seconds
    peak_name = "fp8" if layout.precision == "fp8" and calibration.get("mfu_peak") == "precision" else "bf16"
    peak = calibration["peak_tflops"][peak_name]
    mfu = model_flops_per_iteration(shape, global_batch_size) / t.seconds / cluster.num_gpus / (peak * 1e12)
    return Prediction(layout, global_batch_size, m, stages, stages[heaviest].total, heaviest,
                      cluster.memory_bytes, t, tokens, mfu, peak, f"dense {peak_name} peak {peak:g} TFLOP/s",
                      calibration.get("_path", calibration.get("gpu_kind", "?")))


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchSpace:
    """What the search enumerates; every field narrows it (``tools/plan.py`` flags of the same names)."""

    tp: Optional[Sequence[int]] = None
    pp: Optional[Sequence[int]] = None
    vpp: Sequence[Optional[int]] = (None, 2)
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16)
    precisions: Sequence[str] = ("bf16", "fp8")
    recompute: Sequence[str] = ("none", "selective", "full")
    distributed_optimizer: Sequence[bool] = (False, True)
    sequence_parallel: Sequence[bool] = (False, True)


def _recompute_options(name: str) -> dict:
    return {"none": {}, "selective": {"recompute_granularity": "selective"},
            "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}[name]


def enumerate_layouts(shape: ModelShape, cluster: Cluster, global_batch_size: int, space: SearchSpace,
                      base: Optional[dict] = None) -> Iterable[Layout]:
    """Every valid layout of the search space (invalid combinations are skipped silently)."""
    n = cluster.num_gpus
    tps = space.tp or [d for d in _divisors(n) if d <= cluster.gpus_per_node]
    pps = space.pp or _divisors(n)
    for tp, pp, vpp, mb, prec, rc, distopt, sp in itertools.product(
            tps, pps, space.vpp, space.micro_batch_sizes, space.precisions, space.recompute,
            space.distributed_optimizer, sorted(set(space.sequence_parallel))):
        if n % (tp * pp):
            continue
        dp = n // (tp * pp)
        if (distopt and dp == 1) or (vpp and pp == 1):
            continue
        if tp == 1 and sp and False in space.sequence_parallel:
            continue  # SP is a no-op without TP: list the layout once
        try:
            layout = Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, sp=sp and tp > 1, distributed_optimizer=distopt,
                            micro_batch_size=mb, precision=prec, **_recompute_options(rc), **(base or {}))
            check_layout(shape, layout, global_batch_size)
        except ValueError:
            continue
        yield layout


def search(shape: ModelShape, cluster: Cluster, calibration: dict, global_batch_size: int,
           space: Optional[SearchSpace] = None, base: Optional[dict] = None) -> List[Prediction]:
    """Predictions for every layout, fitting ones first, then by predicted tokens/s (fastest first)."""
    preds = [predict(shape, lay, cluster, calibration, global_batch_size)
             for lay in enumerate_layouts(shape, cluster, global_batch_size, space or SearchSpace(), base)]
    preds.sort(key=lambda p: (not p.fits, -p.tokens_per_s, p.peak_bytes))
    return preds


# ---- text --------------------------------------------------------------------------------------------------
def format_table(preds: List[Prediction], limit: int = 20) -> str:
    head = ("rank", "layout", "recompute", "prec", "mb", "m", "peak GiB", "stage", "fits", "ms/iter", "tokens/s",
            "MFU")
    rows = []
    for i, p in enumerate(preds[:limit]):
        rows.append((str(i + 1), p.layout.describe(), p.layout.recompute_label(), p.layout.precision,
                     str(p.layout.micro_batch_size), str(p.num_microbatches), f"{p.peak_bytes / GIB:.1f}",
                     str(p.heaviest_stage), "yes" if p.fits else "NO", f"{p.ms_per_iter:.1f}",
                     f"{p.tokens_per_s:,.0f}", f"{100 * p.mfu:.1f}%"))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(c.rjust(w) if j not in (1, 2) else c.ljust(w) for j, (c, w) in  # noqa: E731
                               enumerate(zip(r, widths)))
    out = [line(head), line(tuple("-" * w for w in widths))] + [line(r) for r in rows]
    return "\n".join(out)


def format_prediction(pred: Prediction) -> str:
    """A readable account of one layout: memory per stage and its parts, time and its parts, fit or not."""
    lay = pred.layout
    heavy = pred.stages[pred.heaviest_stage]
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [f"layout: {lay.describe()} | recompute {lay.recompute_label()} | {lay.precision} | micro-batch "
             f"{lay.micro_batch_size} x {pred.num_microbatches} microbatches (global batch {pred.global_batch_size})",
             "parameters per (tensor, pipeline) rank: " + ", ".join(
                 f"stage {st.pp_rank}: {st.params:,}" for st in pred.stages),
             "peak memory per stage: " + ", ".join(f"{st.pp_rank}: {g(st.total)}" for st in pred.stages),
             f"heaviest stage {pred.heaviest_stage}: params {g(heavy.state['params'])} | main grads "
             f"{g(heavy.state['main_grads'])} | main params {g(heavy.state['main_params'])} | optimizer state "
             f"{g(heavy.state['optimizer_state'])} | activations {g(heavy.activations)} | transient "
             f"{g(heavy.transient)} | allocator peak {g(pred.peak_bytes)} | with cached blocks, CUDA context "
             f"and NCCL buffers {g(pred.required_bytes)}"]
    margin = pred.memory_limit_bytes - pred.required_bytes
    if pred.fits:
        lines.append(f"fits: {g(margin)} free of {g(pred.memory_limit_bytes)} per GPU")
    else:
        lines.append(f"DOES NOT FIT: {g(-margin)} over the {g(pred.memory_limit_bytes)} per GPU "
                     f"({100 * -margin / pred.memory_limit_bytes:.1f}% over)")
    t = pred.time
    lines.append(f"iteration {pred.ms_per_iter:.1f} ms: microbatch {t.per_microbatch * 1e3:.2f} ms x "
                 f"{pred.num_microbatches}, bubble {t.bubble * 1e3:.1f}, pipeline p2p {t.pp_comm * 1e3:.1f}, "
                 f"data-parallel {t.dp_comm * 1e3:.1f}, optimizer {t.optimizer * 1e3:.1f}, fixed {t.overhead * 1e3:.1f}")
    lines.append("  per iteration on the slowest stage: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in t.parts.items()))
    lines.append(f"throughput {pred.tokens_per_s:,.0f} tokens/s, MFU {100 * pred.mfu:.1f}% "
                 f"(model FLOPs / {pred.mfu_peak_name} per GPU)")
    return "\n".join(lines)
