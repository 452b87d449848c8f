"""Predicted iteration time from a calibration file of measured rates (GEMM, attention, element-wise, collectives).

One microbatch of one chunk costs its GEMMs (forward, input-gradient and weight-gradient: 3x the forward FLOPs,
each GEMM at the rate measured for its size), the causal attention (forward + backward = 3.5x the forward
FLOPs), the element-wise passes (LayerNorm, bias-dropout-add, GeLU, cross-entropy: bytes moved / measured
bandwidth), recomputation (the forward parts recomputed), exposed tensor-parallel collectives, and a fixed
host overhead. The iteration is ``(m + (pp - 1) / vpp)`` microbatch times of the slowest pipeline rank (the
1F1B bubble), plus exposed pipeline send/receive, the data-parallel gradient reduction (and the parameter
all-gather of the distributed optimizer), the optimizer step, and a fixed per-iteration overhead. A chunk never
runs faster than its host floor (the measured Python and kernel-launch time per layer, the forward again for each
fully recomputed layer, and the head and loss work of the last chunk; none under a CUDA graph).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List

from megatron.core.model_counts import num_floating_point_operations
from megatron.core.planner.shapes import Chunk, Cluster, Layout, ModelShape, stage_chunks

CALIBRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations")
REQUIRED_KEYS = ("gpu_kind", "peak_tflops", "gemm_tflops", "attention_tflops", "elementwise_gbps", "collectives",
                 "overheads", "memory")


def load_calibration(kind_or_path: str) -> dict:
    """A calibration by GPU kind (``h200``: the shipped file) or by path; one clear error when it is unusable."""
    path = kind_or_path
    if not os.path.exists(path):
        path = os.path.join(CALIBRATION_DIR, f"{kind_or_path.lower()}.json")
    if not os.path.exists(path):
        shipped = sorted(f[:-5] for f in os.listdir(CALIBRATION_DIR) if f.endswith(".json"))
        raise ValueError(f"--calibration / --gpu-kind {kind_or_path!r}: no such file and no shipped calibration "
                         f"(shipped: {', '.join(shipped)}; make one with tools/plan.py --calibrate)")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration file {path}: not readable JSON ({exc})") from None
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise ValueError(f"calibration file {path}: missing {', '.join(missing)}")
    data["_path"] = path
    return data


def calibrated_gpu_memory_gb(cal: dict) -> float:
    """The memory per GPU a fit is checked against when ``--gpu-memory-gb`` is not given, in GB (1e9 bytes): the
    device's total as CUDA reports it (``torch.cuda.mem_get_info``), which ``--calibrate`` stores as
    ``gpu_memory_gb``. The shipped H200 file holds 150.11 GB = 139.8 GiB (the H200 is sold as "141 GB"); the CUDA
    context and library workspaces are subtracted by the fit check itself (``outside_allocator_bytes``)."""
    if "gpu_memory_gb" not in cal:
        raise ValueError(f"calibration {cal.get('_path', cal.get('gpu_kind', '?'))} has no gpu_memory_gb: give "
                         "--gpu-memory-gb")
    return float(cal["gpu_memory_gb"])


def dump_calibration(cal: dict, path: str) -> None:
    """Write a calibration as JSON, each innermost list on one line."""
    text = json.dumps({k: v for k, v in cal.items() if not k.startswith("_")}, indent=1)
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    with open(path, "w") as f:
        f.write(text + "\n")


def interp(points: List[List[float]], x: float) -> float:
    """Piecewise-linear in log(x) through ``[[x, y], ...]``, flat beyond the ends."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def gemm_seconds(cal: dict, m: int, n: int, k: int, precision: str) -> float:
    """One GEMM [m, k] x [k, n] at the calibrated rate for its size (FP8: the rate of the whole FP8 linear,
    its amax and casts included)."""
    flops = 2.0 * m * n * k
    table = cal["gemm_tflops"].get("fp8" if precision == "fp8" else "bf16")
    if precision == "fp32":
        table = cal["gemm_tflops"].get("fp32", [[1.0, cal["peak_tflops"].get("tf32", 400.0) * 0.6]])
    return flops / (interp(table, flops) * 1e12)


def _bw(cal: dict, group_size: int, spans_nodes: bool) -> float:
    c = cal["collectives"]
    return (c["inter_node_busbw_gbps"] if spans_nodes else c["intra_node_busbw_gbps"]) * 1e9


def ring_seconds(cal: dict, nbytes: float, group: int, spans_nodes: bool, kind: str) -> float:
    """All-gather / reduce-scatter (``kind`` ag, rs) or all-reduce (ar) of ``nbytes`` over ``group`` ranks."""
    if group <= 1:
        return 0.0
    factor = 2.0 if kind == "ar" else 1.0
    lat = cal["collectives"].get("latency_us", 10.0) * 1e-6
    return factor * nbytes * (group - 1) / group / _bw(cal, group, spans_nodes) + lat


@dataclass
class ChunkTime:
    gemm: float
    attention: float
    elementwise: float
    recompute: float
    tp_comm: float
    overhead: float
    host: float = 0.0  # the host's Python and kernel-launch work: the GPU cannot finish sooner

    @property
    def total(self) -> float:
        gpu = self.gemm + self.attention + self.elementwise + self.recompute + self.tp_comm
        return max(gpu, self.host) + self.overhead


def chunk_time(shape: ModelShape, layout: Layout, cluster: Cluster, cal: dict, chunk: Chunk) -> ChunkTime:
    """Forward + backward of one microbatch through one chunk on one GPU."""
    s, b, h, f, t = shape.seq_length, layout.micro_batch_size, shape.hidden_size, shape.ffn_hidden_size, layout.tp
    d = shape.kv_channels  # head dim
    qkv, proj = shape.query_projection_size + 2 * shape.kv_projection_size, shape.query_projection_size
    fc1 = f * (2 if shape.gated_linear_unit else 1)
    prec, tokens = layout.precision, s * b
    act = 4 if prec == "fp32" else 2
    ew_rate = cal["elementwise_gbps"] * 1e9
    sp_div = t if layout.sp else 1
    L = chunk.num_layers
    # GEMMs of one layer, forward; backward = dgrad + wgrad of the same size
    layer_gemm_fwd = (gemm_seconds(cal, tokens, qkv // t, h, prec) + gemm_seconds(cal, tokens, h, proj // t, prec)
                      + gemm_seconds(cal, tokens, fc1 // t, h, prec) + gemm_seconds(cal, tokens, h, f // t, prec))
    attn_fwd_flops = 2.0 * s * s * b * proj / t  # QK^T and xV, causal half
    if shape.model == "bert":
        attn_fwd_flops *= 2  # bidirectional: the whole s x s square
    # BERT: bidirectional attention with a key-padding mask (no flash kernel takes one): its own measured rate
    table = cal.get("attention_masked_tflops") if shape.model == "bert" else None
    table = table or cal["attention_tflops"]
    attn_rate = interp([[float(k), v] for k, v in table.items()], float(d)) * 1e12
    attn_fwd = attn_fwd_flops / attn_rate
    if layout.attention_backend == "unfused":
        attn_fwd *= 2.0
    # element-wise bytes of one layer, in 16-bit elements x act / 2: forward, two LayerNorms (read x, write y: 4)
    # and two bias-dropout-adds (read two, write one, mask: 4) on [s(/t), b, h]; the GeLU on [s, b, f/t] (read,
    # write: 2); backward about twice the LayerNorm and bias-dropout-add traffic, the GeLU reads two and writes one
    ew_layer_fwd = (2 * (4 + 4) * act / 2 * tokens * h / sp_div + 2 * act * tokens * f / t)
    ew_layer_bwd = (2 * 2 * (4 + 4) * act / 2 * tokens * h / sp_div + 3 * act * tokens * f / t)
    ew = L * (ew_layer_fwd + ew_layer_bwd) / ew_rate
    gemm = 3 * L * layer_gemm_fwd
    attention = 3.5 * L * attn_fwd
    # recomputation: the forward parts computed again before the backward
    rec = 0.0
    g = layout.recompute_granularity
    if g == "selective":
        n = L if layout.recompute_num_layers is None else min(L, layout.recompute_num_layers)
        if "core_attn" in layout.recompute_modules:
            rec += n * attn_fwd
        if "mlp_act" in layout.recompute_modules:
            rec += n * 4 * act / 2 * tokens * f / t / ew_rate
    elif g == "full":
        n = L if layout.recompute_method == "uniform" else min(L, layout.recompute_num_layers or 1)
        rec += n * (layer_gemm_fwd + attn_fwd + ew_layer_fwd / ew_rate)
    # tensor-parallel collectives per layer: with SP 2 all-gathers + 2 reduce-scatters forward and the same
    # backward; without SP 2 all-reduces forward (g) and 2 backward (f), each twice the volume of an AG/RS
    tp_spans = t > cluster.gpus_per_node
    msg = act * tokens * h
    per = ring_seconds(cal, msg, t, tp_spans, "ag" if layout.sp else "ar")
    n_fwd = 4 if layout.sp else 2
    n_coll = 2 * n_fwd + (n_fwd if g == "full" else 0)  # full recomputation repeats the forward ones
    tp_comm = L * n_coll * per if t > 1 else 0.0
    over = cal["overheads"]
    overhead = L * over.get("per_layer_ms", 0.0) * 1e-3
    # host floor: forward + backward of each layer (measured by --calibrate; absent: no floor), plus the forward
    # again of every fully recomputed layer: host_recompute_fraction of the layer's host work (the forward runs
    # module code in Python, the backward mostly in the autograd engine, so the forward is more than the third
    # of the kernel launches it issues), plus the embedding, head and loss work of one micro-batch
    host_layer = over.get("host_ms_per_layer", {}).get("fp8" if prec == "fp8" else "bf16", 0.0) * 1e-3
    n_full = 0 if g != "full" else (L if layout.recompute_method == "uniform" else
                                    min(L, layout.recompute_num_layers or 1))
    host = host_layer * (L + n_full * over.get("host_recompute_fraction", 1.0 / 3.0))
    if chunk.post:
        host += over.get("host_ms_per_microbatch", {}).get(shape.model, 0.0) * 1e-3
    if layout.cuda_graph:
        host = 0.0  # a replayed graph launches nothing
    if chunk.pre:
        ew += 8 * tokens * h / ew_rate
    if chunk.post:
        v = shape.padded_vocab(t)
        rows = shape.lm_positions * b  # BERT: the masked-LM head projects only its selected positions
        gemm += 3 * gemm_seconds(cal, rows, v // t, h, "bf16" if prec == "fp8" else prec)
        fused = layout.cross_entropy_fusion and t == 1 and shape.model == "gpt"  # BERT: the eager loss
        ew += (4 if fused else 28) * rows * v / t / ew_rate
        ew += (4 + 8) * act / 2 * tokens * h / sp_div / ew_rate  # final LayerNorm forward and backward
        if shape.model == "bert":  # LM-head transform: dense h x h, GeLU and LayerNorm, forward and backward
            gemm += 3 * gemm_seconds(cal, tokens, h, h, "bf16" if prec == "fp8" else prec)
            ew += (5 + 12) * act / 2 * tokens * h / sp_div / ew_rate
        if t > 1:  # the output layer's input: gathered (SP) or all-reduced in backward
            tp_comm += (2 if layout.sp else 1) * ring_seconds(cal, msg, t, tp_spans, "ag" if layout.sp else "ar")
    return ChunkTime(gemm, attention, ew, rec, tp_comm, overhead, host)


@dataclass
class IterationTime:
    seconds: float
    per_microbatch: float
    bubble: float
    pp_comm: float
    dp_comm: float
    optimizer: float
    overhead: float
    parts: Dict[str, float]


def iteration_time(shape: ModelShape, layout: Layout, cluster: Cluster, cal: dict, num_microbatches: int,
                   stepped_elements: int, buffer_elements: int) -> IterationTime:
    """Seconds per iteration; ``stepped_elements``/``buffer_elements`` of the heaviest rank (memory model)."""
    over = cal["overheads"]
    m, v, pp, t = num_microbatches, layout.chunks, layout.pp, layout.tp
    per_rank = []
    for r in range(pp):
        times = [chunk_time(shape, layout, cluster, cal, c) for c in stage_chunks(shape, layout, r)]
        per_rank.append(times)
    rank_mb = [sum(ct.total for ct in times) + over.get("per_microbatch_ms", 0.0) * 1e-3 for times in per_rank]
    slowest = max(rank_mb)
    bubble = (pp - 1) / v * slowest if pp > 1 else 0.0
    compute = m * slowest
    act = 4 if layout.precision == "fp32" else 2
    pp_comm = 0.0
    if pp > 1:
        msg = act * shape.seq_length * layout.micro_batch_size * shape.hidden_size / (t if layout.sp else 1)
        pp_spans = t * layout.dp * pp > cluster.gpus_per_node
        bw = _bw(cal, 2, pp_spans)
        pp_comm = 2 * m * v * (msg / bw + cal["collectives"].get("latency_us", 10.0) * 1e-6)
    dp_comm = 0.0
    if layout.dp > 1:
        dp_spans = t * layout.dp > cluster.gpus_per_node
        grad_bytes = 4 * buffer_elements
        if layout.distributed_optimizer:
            dp_comm = (ring_seconds(cal, grad_bytes, layout.dp, dp_spans, "rs")
                       + ring_seconds(cal, layout.param_bytes * buffer_elements, layout.dp, dp_spans, "ag"))
        else:
            dp_comm = ring_seconds(cal, grad_bytes, layout.dp, dp_spans, "ar")
        if layout.overlap_grad_reduce:
            dp_comm *= cal["collectives"].get("overlap_exposed_fraction", 0.25)
    # optimizer: AdamW reads p, g, m, v and writes p, m, v (+ the 16-bit copy); grads zeroed; norm read
    opt_bytes = (30 if layout.param_bytes == 2 else 28) * stepped_elements + 8 * buffer_elements
    optimizer = opt_bytes / (cal.get("hbm_gbps", cal["elementwise_gbps"]) * 1e9)
    overhead = over.get("per_iteration_ms", 0.0) * 1e-3
    total = compute + bubble + pp_comm + dp_comm + optimizer + overhead
    heaviest = per_rank[rank_mb.index(slowest)]
    parts = {k: m * sum(getattr(ct, k) for ct in heaviest) for k in
             ("gemm", "attention", "elementwise", "recompute", "tp_comm", "overhead")}
    return IterationTime(total, slowest, bubble, pp_comm, dp_comm, optimizer, overhead, parts)


def model_flops_per_iteration(shape: ModelShape, global_batch_size: int) -> float:
    """Model FLOPs (no recomputation): the trainer's log-line count (``megatron.core.model_counts``)."""
    return num_floating_point_operations(shape.spec_at(1), global_batch_size)
