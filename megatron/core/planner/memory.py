"""Predicted memory per GPU: exact model/optimizer state, activations per layer, in-flight microbatches, peak.

State (exact; compared byte for byte with the real DDP wrapper and optimizers in the tests):

* parameters: param dtype (2 bytes under bf16/fp16/FP8, 4 under fp32); under the distributed optimizer the
  parameters live in the DDP parameter buffer, whose buckets are padded to a multiple of ``128 * DP`` elements;
* main gradients: the contiguous fp32 DDP buffer (padded like the parameter buffer under the distributed
  optimizer), one per model chunk;
* main parameters: fp32 copies of the 16-bit parameters (none under fp32: the optimizer steps the model's own);
  under the distributed optimizer only the elements of this DP rank's shard of every bucket, padding excluded;
* optimizer state: Adam's two fp32 moments (SGD: one momentum buffer) per stepped element.

Activations follow Korthikanti et al. 2022 with the terms this framework keeps (``docs/planner.md``), on CUDA (the
default) or, with ``device="cpu"``, as the same code keeps them on the CPU (``tests/unit/planner`` measures those).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Tuple

from megatron.core.planner.shapes import Chunk, Layout, ModelShape, chunk_param_numels, stage_chunks

SHARD_ALIGN = 128  # elements; distributed-optimizer bucket padding unit per DP rank (distributed/grad_buffer.py)
PARAM_ALIGN = 16  # elements; every parameter's range in a DDP buffer starts at a multiple of this


def _align_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


def buckets_of(numels: List[int], bucket_size, dp: int, sharded: bool) -> List[Tuple[List[Tuple[int, int]], int]]:
    """``(parameter ranges, padded elements)`` of each bucket of one DDP buffer, ranges relative to the bucket's
    start; ``numels`` in buffer (reverse) order. Mirrors ``distributed/grad_buffer.py``."""
    out, ranges, current = [], [], 0
    for i, n in enumerate(numels):
        start = _align_up(current, PARAM_ALIGN)
        ranges.append((start, start + n))
        current = start + n
        if i == len(numels) - 1 or (bucket_size is not None and current >= bucket_size):
            out.append((ranges, _align_up(current, SHARD_ALIGN * dp if sharded else PARAM_ALIGN)))
            ranges, current = [], 0
    return out


def owned_elements(buckets: List[Tuple[List[Tuple[int, int]], int]], dp: int, dp_rank: int) -> int:
    """Parameter elements (padding excluded) in ``dp_rank``'s shard of every bucket."""
    total = 0
    for ranges, padded in buckets:
        shard = padded // dp
        lo, hi = dp_rank * shard, (dp_rank + 1) * shard
        total += sum(max(0, min(e, hi) - max(s, lo)) for s, e in ranges)
    return total


def state_bytes(shape: ModelShape, layout: Layout, pp_rank: int = 0, dp_rank: int = 0) -> Dict[str, int]:
    """Exact bytes of params, main grads, main params and optimizer state on one rank (any TP rank)."""
    params = grads = stepped = 0
    pbytes = layout.param_bytes
    for chunk in stage_chunks(shape, layout, pp_rank):
        numels = chunk_param_numels(shape, layout.tp, chunk)
        if not numels:
            continue
        bks = buckets_of(list(reversed(numels)), layout.ddp_bucket_size, layout.dp, layout.distributed_optimizer)
        padded = sum(p for _, p in bks)
        grads += 4 * padded  # fp32 main-grad buffer (grad_reduce_in_fp32)
        if layout.distributed_optimizer:
            params += pbytes * padded
            stepped += owned_elements(bks, layout.dp, dp_rank)
        else:
            params += pbytes * sum(numels)
            stepped += sum(numels)
    main_params = 4 * stepped if pbytes == 2 else 0
    moments = 2 if layout.optimizer == "adam" else 1
    opt_state = 4 * moments * stepped
    return {"params": params, "main_grads": grads, "optimizer_state": opt_state, "main_params": main_params,
            "total": params + grads + opt_state + main_params}


def param_count(shape: ModelShape, layout: Layout, pp_rank: int) -> int:
    """Parameters held by one (TP, PP) rank: all its chunks, without padding."""
    return sum(sum(chunk_param_numels(shape, layout.tp, c)) for c in stage_chunks(shape, layout, pp_rank))


# ---- activations ---------------------------------------------------------------------------------------
DEVICES = ("cuda", "cpu")


def _element_bytes(layout: Layout, device: str) -> Tuple[int, int, int]:
    """``(activation, dropout mask, LayerNorm statistic)`` bytes per element on ``device``.

    CUDA: PyTorch's dropout keeps a bool mask (1 byte) and LayerNorm its mean and rstd in fp32 (the Triton kernel
    too). CPU: PyTorch's dropout keeps its scaled noise in the activation dtype, and LayerNorm its statistics in
    the parameters' dtype (here the activation dtype).
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    act = 4 if layout.precision == "fp32" else 2
    return (act, 1, 4) if device == "cuda" else (act, act, act)


def layer_activation_bytes(shape: ModelShape, layout: Layout, mode: str, device: str = "cuda") -> float:
    """Bytes one transformer layer keeps for backward for one microbatch; ``mode`` none / selective / full.

    Terms (16-bit activations, ``t`` = TP size, ``/t*`` = divided by t only under sequence parallelism; ``m`` and
    ``r`` = bytes of a dropout-mask element and of a LayerNorm statistic, ``_element_bytes``):
    both LayerNorm inputs 4sbh /t*, their statistics 2 x 2r sb /t*, both LayerNorm outputs 4sbh /t* (the
    column-parallel GEMMs' inputs: under SP each keeps only its sequence shard and gathers it again in backward),
    q/k/v 6sbh/t and the attention output 2sbh/t (flash attention keeps them; its softmax statistics 4asb/t in
    fp32), the FC1 output 2sbf/t and the GeLU output 2sbf/t, two hidden-dropout masks 2m sbh /t* when
    --hidden-dropout > 0, none with the fused bias-dropout-add on CUDA (it regenerates its mask from a seed).
    Selective recomputation drops the GeLU output (mlp_act) and the attention statistics (core_attn); the unfused
    attention adds the softmax output 2as^2b/t and with attention dropout its mask and output (2 + m + 2)as^2b/t.
    Query/key norms (--qk-layernorm) or RoPE make new q and k tensors (the attention's inputs) of 2s(q + k)b/t, and
    each RoPE rotation of q and of k keeps its fp32 cosines and sines, 4 x 4 s r per layer (r rotated channels).
    FP8 GEMMs keep 1-byte copies of their inputs: LayerNorm outputs 2sbh (gathered under SP), attention output
    sbh/t (its 16-bit copy is kept only when the attention core is not recomputed), GeLU output sbf/t, plus the
    transposed FP8 weights. Full recomputation keeps the layer input only: 2sbh /t*.
    """
    s, b, h, a, f, t = shape.seq_length, layout.micro_batch_size, shape.hidden_size, shape.num_attention_heads, \
        shape.ffn_hidden_size, layout.tp
    qkv = shape.query_projection_size + 2 * shape.kv_projection_size  # grouped-query attention: fewer k, v
    glu = 2 if shape.gated_linear_unit else 1  # SwiGLU: FC1 holds [gate; up]
    sp_div = t if layout.sp else 1
    act, mask, stat = _element_bytes(layout, device)
    if mode == "full":
        return act * s * b * h / sp_div
    sel = mode == "selective"
    core = sel and "core_attn" in layout.recompute_modules
    gelu = sel and "mlp_act" in layout.recompute_modules
    fp8 = layout.precision == "fp8"
    sbh, sbf = s * b * h, s * b * f
    total = 2 * act * sbh / sp_div + 2 * 2 * stat * s * b / sp_div  # LayerNorm inputs and statistics
    total += 2 * sbh if fp8 else 2 * act * sbh / sp_div  # LayerNorm outputs (FP8: gathered 1-byte copies)
    total += act * s * b * qkv / t  # q, k, v (grouped-query attention: fewer k, v)
    if shape.qk_layernorm or shape.position_embedding_type == "rope":
        # the q and k the attention reads are new tensors (normalised and/or rotated), not views of the QKV output
        total += act * s * b * (shape.query_projection_size + shape.kv_projection_size) / t
    if shape.position_embedding_type == "rope":
        total += 4 * 4 * s * int(shape.kv_channels * shape.rotary_percent)  # fp32 cos and sin of the q and k rotations
    if fp8:
        total += sbh / t + (0 if core else act * sbh / t)  # 1-byte projection input; 16-bit attention output
    else:
        total += act * sbh / t  # attention output = projection input
    if layout.attention_backend == "unfused":
        if not core:
            per_score = act + (mask + act if shape.attention_dropout > 0 else 0)  # probs (+ mask, dropped probs)
            total += per_score * a * s * s * b / t
    elif not core:
        total += 4 * a * s * b / t  # flash softmax statistics, fp32
    total += act * sbf * glu / t  # FC1 output (the GeLU input; [gate; up] under SwiGLU)
    if not gelu:
        total += (1 if fp8 else act) * sbf / t  # GeLU output (the FC2 input)
    if shape.hidden_dropout > 0 and not (device == "cuda" and layout.bias_dropout_fusion):
        total += 2 * mask * sbh / sp_div  # two dropout masks
    if fp8:
        total += (h * qkv + shape.query_projection_size * h + (glu + 1) * h * f) / t  # transposed FP8 weights
        total += 4 * (7 if core else 8)  # fp32 scales of the GEMM operands
    return total


def _layer_modes(layout: Layout, n: int) -> List[str]:
    """Recomputation mode of each of the ``n`` layers of one chunk (``transformer/block.py``)."""
    g, k = layout.recompute_granularity, layout.recompute_num_layers
    if g is None:
        return ["none"] * n
    if g == "selective":
        k = n if k is None else min(k, n)
        return ["selective"] * k + ["none"] * (n - k)
    if layout.recompute_method == "block":
        k = 1 if k is None else min(k, n)
        return ["full"] * k + ["none"] * (n - k)
    return ["full"] * n  # uniform: groups of k layers, each keeping its input only


@dataclass
class ChunkActivations:
    kept: float  # bytes one microbatch of this chunk keeps until its backward
    transient: float  # extra working set while one microbatch of this chunk runs (recompute, logits, loss)


def chunk_activations(shape: ModelShape, layout: Layout, chunk: Chunk, device: str = "cuda") -> ChunkActivations:
    s, b, h, t = shape.seq_length, layout.micro_batch_size, shape.hidden_size, layout.tp
    act, mask, stat = _element_bytes(layout, device)
    sp_div = t if layout.sp else 1
    modes = _layer_modes(layout, chunk.num_layers)
    full_layer = layer_activation_bytes(shape, layout, "none", device)
    if layout.recompute_granularity == "full" and layout.recompute_method == "uniform":
        k = layout.recompute_num_layers or 1
        groups = -(-chunk.num_layers // k)
        kept = groups * layer_activation_bytes(shape, layout, "full", device)
        transient = min(k, chunk.num_layers) * full_layer  # one group recomputed in backward
    else:
        kept = sum(layer_activation_bytes(shape, layout, m, device) for m in modes)
        transient = full_layer if "full" in modes else 0.0
    transient = max(transient, full_layer * 0.5)  # one layer's gradients during its backward
    if chunk.pre and shape.hidden_dropout > 0:
        kept += mask * s * b * h / sp_div  # embedding dropout mask (PyTorch's dropout)
    if chunk.post:
        v = shape.padded_vocab(t)
        rows = shape.lm_positions * b  # positions projected onto the vocabulary (BERT: the masked-LM selection)
        sbh, ln_stats = s * b * h, 2 * stat * s * b / sp_div  # one LayerNorm's mean and rstd
        if shape.model == "bert":
            # final LayerNorm input and output (the LM-head dense input), the dense output and the GeLU output,
            # on this rank's sequence slice, and both LayerNorms' statistics; the vocabulary GEMM's input is the
            # selected rows only, with the selection's int64 row indices (index_select), int64 positions
            # (scatter back to [b, s]) and 1-byte used-slot mask
            kept += 4 * act * sbh / sp_div + 2 * ln_stats + act * rows * h + 17 * rows
            if shape.bert_binary_head:  # the pooler's tanh output [b, h]; under SP it keeps the gathered input
                kept += act * b * h + (act * sbh if layout.sp else 0)
        else:  # final LayerNorm input and statistics; its output gathered for the GEMM
            kept += act * sbh / sp_div + ln_stats + act * sbh
        logits = act * rows * v / t
        fused = layout.cross_entropy_fusion and t == 1 and shape.model == "gpt"
        # the eager vocab-parallel loss (BERT's always) keeps one fp32 copy of the local logits (softmax, then
        # its gradient in place) and casts the gradient back, and keeps its int64 local targets and a 1-byte
        # outside-this-shard mask; the fused loss (GPT, TP 1) writes the gradient into the logits
        if not fused:
            kept += 9 * rows
        transient = max(transient, logits + (0 if fused else 4 * rows * v / t))
    return ChunkActivations(kept, transient)


def in_flight_peak(layout: Layout, pp_rank: int, num_microbatches: int, sizes: List[float]) -> float:
    """Largest sum of ``sizes[chunk]`` over the microbatches whose forward ran and backward did not (schedule)."""
    if layout.pp == 1:
        return max(sizes)  # forward then backward of one microbatch at a time
    m = num_microbatches
    cap = layout.pp * (layout.chunks + 2)  # the schedule reaches its steady state well before this
    if m > cap:
        m = cap - cap % layout.pp if layout.vpp else cap
    live = peak = 0.0
    for forward, chunk in _order(layout.pp, pp_rank, m, layout.chunks):
        if forward:
            live += sizes[chunk]
            peak = max(peak, live)
        else:
            live -= sizes[chunk]
    return peak


@functools.lru_cache(maxsize=1024)
def _order(pp: int, pp_rank: int, m: int, chunks: int) -> Tuple[Tuple[bool, int], ...]:
    """``(is_forward, chunk)`` of the compute actions of one rank, from the trainer's own schedule."""
    from megatron.core.pipeline_parallel.actions import ActionKind
    from megatron.core.pipeline_parallel.schedules import compute_order

    return tuple((a.kind == ActionKind.FORWARD, a.chunk) for a in compute_order(pp, pp_rank, m, chunks))


@dataclass
class StageMemory:
    pp_rank: int
    state: Dict[str, int]
    activations: float
    transient: float
    total: float  # predicted peak of the PyTorch allocator (torch.cuda.max_memory_allocated)
    required: float  # what the GPU must hold: total x reserved/allocated + memory outside the allocator
    params: int


def stage_memory(shape: ModelShape, layout: Layout, num_microbatches: int, calibration: dict,
                 pp_rank: int) -> StageMemory:
    """Peak bytes of one pipeline rank (DP rank 0: the largest distributed-optimizer shard).

    ``total`` is the allocator's peak (what ``torch.cuda.max_memory_allocated`` reports). Whether a layout fits is
    decided on ``required``: the allocator keeps more than it hands out (cached, fragmented blocks: the
    calibration's ``reserved_over_allocated``, measured by ``bench/plan_validation.py --run``), and the CUDA
    context, cuBLAS workspaces and NCCL buffers live outside it (``outside_allocator_bytes``, plus
    ``nccl_buffer_bytes`` when any parallel group has more than one rank).
    """
    chunks = stage_chunks(shape, layout, pp_rank)
    acts = [chunk_activations(shape, layout, c) for c in chunks]
    kept = in_flight_peak(layout, pp_rank, num_microbatches, [a.kept for a in acts])
    transient = max(a.transient for a in acts)
    state = state_bytes(shape, layout, pp_rank, 0)
    total = state["total"] + kept + transient
    mem = calibration.get("memory", {})
    outside = float(mem.get("outside_allocator_bytes", 0))
    if layout.dp > 1 or layout.tp > 1 or layout.pp > 1:
        outside += float(mem.get("nccl_buffer_bytes", 0))
    required = total * float(mem.get("reserved_over_allocated", 1.0)) + outside
    return StageMemory(pp_rank, state, kept, transient, total, required, param_count(shape, layout, pp_rank))


def peak_memory(shape: ModelShape, layout: Layout, num_microbatches: int, calibration: dict) -> StageMemory:
    """The heaviest pipeline stage."""
    stages = [stage_memory(shape, layout, num_microbatches, calibration, r) for r in range(layout.pp)]
    return max(stages, key=lambda st: st.total)
