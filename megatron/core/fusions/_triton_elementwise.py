"""Triton kernels for bias+GeLU and bias+dropout+residual-add, wrapped in autograd Functions.

Each kernel makes one pass over the tensor (fp32 arithmetic, output in the input dtype) instead of the two or
three passes of the eager PyTorch composition, and saves less for backward:

- bias+GeLU saves the GEMM output ``x`` (which the next GEMM does not need) and the bias, not ``x + bias``;
- bias+dropout+add never stores a dropout mask: the mask is regenerated in backward from a Philox seed drawn
  from the current CUDA generator (so the tensor-parallel RNG tracker and activation recomputation, which
  restore generator states, reproduce the same mask).

It also holds ``column_sum``, the bias gradient of a linear layer (column sums of a ``[tokens, n]`` gradient),
in one launch: a few programs per multiprocessor, each summing many row tiles of one column block in fp32
registers into one row of a small partial array; the last program of a column block to finish (an arrival
counter per block, ``_finish_if_last``) adds that block's partial rows in a fixed order and casts. PyTorch's
``x.sum(0)`` is further from memory bandwidth on these shapes (bench/results/kernel_sweep.md). The bias+GeLU
backward finishes its bias gradient the same way.

Switch: ``FINISH_IN_LAST_PROGRAM`` (read at every call) set to False finishes those sums in a separate launch
of ``_colsum_finish_kernel`` instead (``sum_partial_rows``), for an A/B of the arrival counter.

Import this module only when ``triton`` is importable; ``ops.py`` decides when to use it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from megatron.core.grad_record import reduce_into_sink, sink_output, sink_result

# Tiles: BLOCK_M rows x BLOCK_N columns of the tensor viewed as [M, N] (N = last dimension). Each program walks
# ROW_TILES row tiles of one column block, so the bias is loaded once and bias-gradient partial sums stay in
# registers; no per-element integer modulo is needed to find the bias column. One (BLOCK_M, BLOCK_N, num_warps,
# programs per multiprocessor) per kernel, chosen by bench/kernel_sweep.py (results in
# bench/results/kernel_sweep.md); the dropout backward (only used with dropout > 0) was not swept.
TILE_CONFIG = {
    "gelu_fwd": (8, 256, 4, 64),
    "gelu_bwd": (16, 128, 4, 32),
    "bda_fwd": (8, 256, 4, 32),
    "dropout_bwd": (16, 256, 4, 64),
}

# column_sum: BLOCK_M x BLOCK_N tiles, programs_per_sm x multiprocessors programs in all, split over the column
# blocks; each walks its share of the row tiles. Several programs per multiprocessor keep enough loads in
# flight; bench/kernel_sweep.py --only colsum times the alternatives (results in bench/results/kernel_sweep.md).
COLSUM_CONFIG = {"block_m": 16, "block_n": 64, "num_warps": 8, "programs_per_sm": 4}
FINISH_IN_LAST_PROGRAM = True  # False: a separate finishing launch (module docstring)
# The finishing kernel: columns per program and partial rows per load (the partial array has at most
# programs_per_sm x multiprocessors rows, that many only when n fits in one column block).
_COLSUM_FINISH_BLOCK_N = 32
_COLSUM_FINISH_BLOCK_R = 64


@triton.jit
def _gelu_cdf_and_gauss(z):
    """(Phi(z), exp(-z^2 / 2)) for fp32 ``z``: the normal CDF from erfc(|z| / sqrt 2) ~= t P(t) exp(-z^2 / 2),
    t = 1 / (1 + p |z| / sqrt 2) (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7). One exp and one reciprocal
    instead of libdevice's two-branch erff, which made these kernels instruction-bound rather than
    memory-bound; Phi of negative z comes from erfc directly, without
    the cancellation of 1 + erf(z / sqrt 2). The exp is shared with the backward's Gaussian density."""
    a = tl.abs(z) * 0.7071067811865476
    gauss = tl.exp(-a * a)
    t = 1.0 / (1.0 + 0.3275911 * a)
    erfc = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))) * gauss
    cdf = tl.where(z < 0, 0.5 * erfc, 1.0 - 0.5 * erfc)
    return cdf, gauss


@triton.jit
def gelu_f32(z):
    """GeLU z * Phi(z) of fp32 values (the erf GeLU, max abs error 4.3e-7 over [-10, 10] against float64, where
    PyTorch's fp32 F.gelu is within 1.2e-6); the one definition the bias+GeLU and FP8-quantization kernels
    share, so quantizing gelu(x + b) inside the FP8 kernels gives the bits of quantizing this kernel's output."""
    cdf, _ = _gelu_cdf_and_gauss(z)
    return z * cdf


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, M, N, ROW_TILES, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y = gelu(X + B) for a contiguous X viewed as [M, N]; EVEN: the grid covers [M, N] exactly and M * N <
    2^31, so no masks and 32-bit offsets."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    for t in range(0, ROW_TILES):
        rows = (tl.program_id(1) * ROW_TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        if EVEN:
            offs = rows[:, None] * N + cols[None, :]
            z = tl.load(X + offs).to(tl.float32)
        else:
            mask = (rows < M)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += b[None, :]
        if EVEN:
            tl.store(Y + offs, gelu_f32(z).to(Y.dtype.element_ty))
        else:
            tl.store(Y + offs, gelu_f32(z).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, X, B, DX, DB_PART, DB_OUT, COUNTER, M, N, ROW_TILES, R, HAS_BIAS: tl.constexpr,
                          ACCUMULATE: tl.constexpr, FINISH: tl.constexpr, EVEN: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """DX = DY * gelu'(X + B) with gelu'(z) = Phi(z) + z * phi(z); DB_PART[program row] = column sums of DX, and
    the last of a column block's R programs writes their total to DB_OUT (``_finish_if_last``; ACCUMULATE: added
    to the fp32 DB_OUT; FINISH False: the caller finishes with ``sum_partial_rows``). EVEN as in the forward
    kernel (unmasked loads and stores)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # reduced over rows once, at the end
    for t in range(0, ROW_TILES):
        rows = (tl.program_id(1) * ROW_TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        if EVEN:
            offs = rows[:, None] * N + cols[None, :]
            z = tl.load(X + offs).to(tl.float32)
            dy = tl.load(DY + offs).to(tl.float32)
        else:
            mask = (rows < M)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += b[None, :]
        cdf, gauss = _gelu_cdf_and_gauss(z)
        dx = dy * (cdf + z * gauss * 0.3989422804014327)
        if EVEN:
            tl.store(DX + offs, dx.to(DX.dtype.element_ty))
        else:
            dx = tl.where(mask, dx, 0.0)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += dx
    if HAS_BIAS:
        tl.store(DB_PART + tl.program_id(1) * N + cols, tl.sum(acc, axis=0), mask=cmask)
        if FINISH:
            _finish_if_last(DB_PART, DB_OUT, COUNTER, R, N, cols, cmask, ACCUMULATE, BLOCK_R, BLOCK_N)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch(kernel_name: str, m: int, n: int, device: torch.device):
    """(grid, row tiles per program, launch meta-parameters) for one of the tiled kernels: many programs per
    multiprocessor (enough loads in flight to run at memory bandwidth; a few per multiprocessor do not), each
    program a column block x a short run of row tiles whose bias-gradient partial sums it
    writes once."""
    block_m, block_n, num_warps, per_sm = TILE_CONFIG[kernel_name]
    col_blocks = triton.cdiv(n, block_n)
    row_tiles_total = triton.cdiv(m, block_m)
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    row_groups = max(1, min(row_tiles_total, triton.cdiv(per_sm * sms, col_blocks)))
    per_program = triton.cdiv(row_tiles_total, row_groups)
    row_groups = triton.cdiv(row_tiles_total, per_program)
    return (col_blocks, row_groups), per_program, dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)


def _even(grid, per_program: int, meta: dict, m: int, n: int) -> bool:
    """True when a ``_launch`` grid covers ``[m, n]`` exactly (no masks needed) with 32-bit offsets."""
    return grid[1] * per_program * meta["BLOCK_M"] == m and n % meta["BLOCK_N"] == 0 and m * n < 2**31


@triton.jit
def _colsum_partial_kernel(X, PART, OUT, COUNTER, M, N, ROW_TILES, R, ACCUMULATE: tl.constexpr,
                           FINISH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_R: tl.constexpr):
    """PART[g, cols] = sum of X[rows, cols] over the row tiles g*ROW_TILES .. (g+1)*ROW_TILES - 1 of column
    block program_id(0) (g = program_id(1)), for a contiguous X [M, N]; fp32 sums, stored in PART's dtype
    (ACCUMULATE, one row group only: added to PART's fp32 values). FINISH: the last of the R row groups of a
    column block writes the block's total to OUT (``_finish_if_last``; ACCUMULATE then means adding to OUT)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    first = tl.program_id(1) * ROW_TILES
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # element-wise over the tiles, reduced over rows at the end
    for t in range(0, ROW_TILES):
        rows = (first + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & cmask[None, :]
        acc += tl.load(X + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    if ACCUMULATE and not FINISH:
        total += tl.load(PART + cols, mask=cmask, other=0.0)
    tl.store(PART + tl.program_id(1).to(tl.int64) * N + cols, total.to(PART.dtype.element_ty), mask=cmask)
    if FINISH:
        _finish_if_last(PART, OUT, COUNTER, R, N, cols, cmask, ACCUMULATE, BLOCK_R, BLOCK_N)


@triton.jit
def _sum_rows(PART, OUT, R, N, cols, cmask, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
              BYPASS_L1: tl.constexpr):
    """OUT[cols] = sum over the R rows of the fp32 PART [R, N] (BLOCK_R rows per load, then a tree over them),
    cast to OUT's dtype (ACCUMULATE: added to the fp32 OUT)."""
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & cmask[None, :]
        if BYPASS_L1:
            acc += tl.load(PART + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0,
                           cache_modifier=".cg")
        else:
            acc += tl.load(PART + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if ACCUMULATE:
        total += tl.load(OUT + cols, mask=cmask, other=0.0)
    tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=cmask)


@triton.jit
def _colsum_finish_kernel(PART, OUT, PART2, OUT2, R, N, ACCUMULATE: tl.constexpr, ACCUMULATE2: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[cols] = sum over the R rows of the fp32 PART [R, N] (``_sum_rows``); the programs with
    program_id(1) == 1 do the same for PART2 / OUT2 (a LayerNorm's two parameters in one launch)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if tl.program_id(1) == 0:
        _sum_rows(PART, OUT, R, N, cols, cmask, ACCUMULATE, BLOCK_R, BLOCK_N, False)
    else:
        _sum_rows(PART2, OUT2, R, N, cols, cmask, ACCUMULATE2, BLOCK_R, BLOCK_N, False)


@triton.jit
def _finish_if_last(PART, OUT, COUNTER, R, N, cols, cmask, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Called by every program of column block program_id(0) after it stored its partial row of PART [R, N]: the
    last of the block's R programs to arrive adds up the R rows in a fixed order (deterministic, as
    ``_colsum_finish_kernel``), into OUT[cols] (ACCUMULATE: added to the fp32 OUT) and re-arms the block's
    counter: one launch less than finishing with ``sum_partial_rows``.

    Triton runs a scalar atomic in one thread after a barrier of the program, so its release orders every
    thread's partial-row stores before the count, and its acquire orders the last program's loads after it
    (the pattern of a grid-wide barrier). The loads bypass L1 (.cg)."""
    arrived = tl.atomic_add(COUNTER + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
    if arrived == R - 1:
        _sum_rows(PART, OUT, R, N, cols, cmask, ACCUMULATE, BLOCK_R, BLOCK_N, True)
        tl.atomic_xchg(COUNTER + tl.program_id(0), 0)


_COUNTERS: dict = {}
_OUTGROWN_COUNTERS: list = []  # arrays replaced by larger ones: a captured CUDA graph may still use them


def _block_counters(device: torch.device, blocks: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``_finish_if_last``, one per column block. One array per device and
    stream, kept and reused: each finishing program sets its counter back to zero, and kernels of one stream
    run one after another. An outgrown array is kept alive, never freed, so that a CUDA graph that captured it
    does not replay into memory the allocator has handed to another tensor."""
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < blocks:
        if counters is not None:
            _OUTGROWN_COUNTERS.append(counters)
        counters = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def _colsum_launch(m: int, n: int, device: torch.device):
    """(column blocks, row groups, row tiles per program) of ``_colsum_partial_kernel`` for an [m, n] tensor:
    about programs_per_sm x multiprocessors programs, each with an equal run of row tiles."""
    cfg = COLSUM_CONFIG
    col_blocks = triton.cdiv(n, cfg["block_n"])
    row_tiles = triton.cdiv(m, cfg["block_m"])
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    programs = max(1, int(cfg["programs_per_sm"] * sms))
    row_groups = max(1, min(row_tiles, triton.cdiv(programs, col_blocks)))
    per_program = triton.cdiv(row_tiles, row_groups)
    return col_blocks, triton.cdiv(row_tiles, per_program), per_program


def _check_out(out: Optional[torch.Tensor], n: int, device: torch.device, accumulate: bool) -> None:
    """An ``out`` given to a column sum: a contiguous ``[n]`` tensor on ``device``, fp32 when added to."""
    if out is not None and (out.shape != (n,) or not out.is_contiguous() or out.device != device
                            or (accumulate and out.dtype != torch.float32)):
        raise ValueError(f"out must be a contiguous [{n}] tensor on {device} (fp32 to accumulate into), got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")


def sum_partial_rows(part: torch.Tensor, out_dtype: torch.dtype, out: Optional[torch.Tensor] = None,
                     accumulate: bool = False) -> torch.Tensor:
    """``part.sum(0)`` cast to ``out_dtype`` for a contiguous fp32 ``[rows, n]`` array of per-program partial
    sums (the bias-gradient and LayerNorm weight-gradient partials of the backward kernels): one launch of the
    finishing kernel instead of PyTorch's reduction and a cast. With ``out`` (e.g. a parameter's ``main_grad``)
    the sums are stored into it, added to its fp32 values with ``accumulate``; returns the output."""
    rows, n = part.shape
    _check_out(out, n, part.device, accumulate)
    out = torch.empty(n, dtype=out_dtype, device=part.device) if out is None else out
    if n:
        _colsum_finish_kernel[(triton.cdiv(n, _COLSUM_FINISH_BLOCK_N), 1)](
            part, out, part, out, rows, n, ACCUMULATE=accumulate, ACCUMULATE2=False,
            BLOCK_R=_COLSUM_FINISH_BLOCK_R, BLOCK_N=_COLSUM_FINISH_BLOCK_N, num_warps=4)
    return out


def sum_partial_rows_pair(part: torch.Tensor, out: torch.Tensor, accumulate: bool, part2: torch.Tensor,
                          out2: torch.Tensor, accumulate2: bool) -> None:
    """``out = part.sum(0)`` and ``out2 = part2.sum(0)`` (added to them with ``accumulate`` / ``accumulate2``,
    fp32 outputs only then) for two contiguous fp32 ``[rows, n]`` partial arrays of one shape, in one launch;
    ``out`` / ``out2`` come from ``grad_record.sink_output``."""
    rows, n = part.shape
    if part2.shape != part.shape:
        raise ValueError(f"sum_partial_rows_pair: shapes {tuple(part.shape)} and {tuple(part2.shape)} differ")
    _check_out(out, n, part.device, accumulate)
    _check_out(out2, n, part.device, accumulate2)
    if n:
        _colsum_finish_kernel[(triton.cdiv(n, _COLSUM_FINISH_BLOCK_N), 2)](
            part, out, part2, out2, rows, n, ACCUMULATE=accumulate, ACCUMULATE2=accumulate2,
            BLOCK_R=_COLSUM_FINISH_BLOCK_R, BLOCK_N=_COLSUM_FINISH_BLOCK_N, num_warps=4)


def column_sum(x2d: torch.Tensor, out_dtype: torch.dtype, out: Optional[torch.Tensor] = None,
               accumulate: bool = False) -> torch.Tensor:
    """Sums of the [m, n] tensor ``x2d`` over its rows (``x2d.sum(0)``), accumulated in fp32 and returned as an
    [n] tensor of ``out_dtype``; m == 0 gives zeros. Deterministic (no atomics): each row group's fp32 partial
    sums go to one row of a [row groups, n] array, and the last program of each column block to finish adds
    those rows up in a fixed order (``_finish_if_last``); with one row group the sums go straight to the
    output. With ``out`` (a contiguous ``[n]`` tensor, e.g. a parameter's ``main_grad``) the sums are stored
    into it, added to its fp32 values with ``accumulate``; returns the output."""
    if x2d.dim() != 2:
        raise ValueError(f"column_sum expects a 2-D tensor, got shape {tuple(x2d.shape)}")
    m, n = x2d.shape
    _check_out(out, n, x2d.device, accumulate)
    out = torch.empty(n, dtype=out_dtype, device=x2d.device) if out is None else out
    if n == 0 or m == 0:
        return out if accumulate else out.zero_()
    x2d = x2d.contiguous()
    col_blocks, row_groups, per_program = _colsum_launch(m, n, x2d.device)
    meta = dict(BLOCK_M=COLSUM_CONFIG["block_m"], BLOCK_N=COLSUM_CONFIG["block_n"],
                num_warps=COLSUM_CONFIG["num_warps"])
    if row_groups == 1:
        _colsum_partial_kernel[(col_blocks, 1)](x2d, out, out, out, m, n, per_program, 1, ACCUMULATE=accumulate,
                                                FINISH=False, BLOCK_R=_COLSUM_FINISH_BLOCK_R, **meta)
        return out
    part = torch.empty((row_groups, n), dtype=torch.float32, device=x2d.device)
    if not FINISH_IN_LAST_PROGRAM:
        _colsum_partial_kernel[(col_blocks, row_groups)](x2d, part, part, part, m, n, per_program, row_groups,
                                                         ACCUMULATE=False, FINISH=False,
                                                         BLOCK_R=_COLSUM_FINISH_BLOCK_R, **meta)
        return sum_partial_rows(part, out_dtype, out, accumulate)
    _colsum_partial_kernel[(col_blocks, row_groups)](x2d, part, out, _block_counters(x2d.device, col_blocks), m, n,
                                                     per_program, row_groups, ACCUMULATE=accumulate, FINISH=True,
                                                     BLOCK_R=_COLSUM_FINISH_BLOCK_R, **meta)
    return out


class BiasGeLUFunction(torch.autograd.Function):
    """gelu(x + bias) (the erf GeLU, ``gelu_f32``): one Triton pass forward; backward writes dx and the bias-grad
    partials in the same pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.shape[-1]
        m = x.numel() // n if n else 0
        if m and n:
            grid, tiles, meta = _launch("gelu_fwd", m, n, x.device)
            _bias_gelu_fwd_kernel[grid](x, bias if bias is not None else x, y, m, n, tiles,
                                        HAS_BIAS=bias is not None, EVEN=_even(grid, tiles, meta, m, n), **meta)
        ctx.has_bias, ctx.bias_param = bias is not None, bias
        ctx.save_for_backward(x, bias) if bias is not None else ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.has_bias:
            x, bias = ctx.saved_tensors
        else:
            (x,), bias = ctx.saved_tensors, None
        return bias_gelu_backward(dy, x, bias, ctx.bias_param)


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                       bias_param: Optional[torch.Tensor] = None):
    """(dx, dbias) of gelu(x + bias) for the upstream gradient ``dy``, in one Triton pass. ``bias_param``: the
    bias Parameter, whose gradient goes into its ``main_grad`` when its layer declared it a gradient sink
    (``megatron/core/grad_record.py``; dbias is then None)."""
    x = x.contiguous()
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    dbias = None
    if m and n:
        grid, tiles, meta = _launch("gelu_bwd", m, n, x.device)
        finish = FINISH_IN_LAST_PROGRAM
        if bias is not None:
            part = torch.empty((grid[1], n), dtype=torch.float32, device=x.device)
            out, acc = sink_output(bias_param, n, bias.dtype, x.device)
            counters = _block_counters(x.device, grid[0]) if finish else part
        else:
            part = out = counters = x
            acc = False
        _bias_gelu_bwd_kernel[grid](dy, x, bias if bias is not None else x, dx, part, out, counters, m, n, tiles,
                                    grid[1], HAS_BIAS=bias is not None, ACCUMULATE=acc, FINISH=finish,
                                    EVEN=_even(grid, tiles, meta, m, n), BLOCK_R=_COLSUM_FINISH_BLOCK_R, **meta)
        if bias is not None:
            if not finish:
                sum_partial_rows(part, bias.dtype, out, acc)
            dbias = sink_result(bias_param, out)
    elif bias is not None:
        dbias = torch.zeros_like(bias)
    return dx, dbias


@triton.jit
def _bias_dropout_add_fwd_kernel(X, B, R, OUT, SEED, M, N, ROW_TILES, p, scale, HAS_BIAS: tl.constexpr,
                                 DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT = R + dropout(X + B); the keep mask is Philox(seed, flat element index) > p."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    if DROPOUT:
        seed = tl.load(SEED)
    for t in range(0, ROW_TILES):
        rows = (tl.program_id(1) * ROW_TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += b[None, :]
        if DROPOUT:
            keep = tl.rand(seed, offs) > p
            z = tl.where(keep, z * scale, 0.0)
        r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offs, (r + z).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_bwd_kernel(DY, DX, DB_PART, SEED, M, N, ROW_TILES, p, scale, DROPOUT: tl.constexpr,
                        WRITE_DX: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """DX = DY * keep * scale with the forward's regenerated mask (or DY itself), plus bias-grad partials."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if DROPOUT:
        seed = tl.load(SEED)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # reduced over rows once, at the end
    for t in range(0, ROW_TILES):
        rows = (tl.program_id(1) * ROW_TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dz = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            keep = tl.rand(seed, offs) > p
            dz = tl.where(keep, dz * scale, 0.0)
        if WRITE_DX:
            tl.store(DX + offs, dz.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += tl.where(mask, dz, 0.0)
    if HAS_BIAS:
        tl.store(DB_PART + tl.program_id(1) * N + cols, tl.sum(acc, axis=0), mask=cmask)


class BiasDropoutAddFunction(torch.autograd.Function):
    """residual + dropout(x + bias) in one Triton pass; no mask is stored (regenerated from the seed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float,
                training: bool) -> torch.Tensor:
        if residual.shape != x.shape:
            raise ValueError(f"bias_dropout_add: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        x = x.contiguous()
        residual = residual.contiguous()
        out_dtype = torch.promote_types(x.dtype, residual.dtype)
        if bias is not None:
            out_dtype = torch.promote_types(out_dtype, bias.dtype)
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        dropout = bool(training) and prob > 0.0
        if dropout and prob >= 1.0:
            raise ValueError(f"dropout probability must be < 1, got {prob}")
        scale = 1.0 / (1.0 - prob) if dropout else 1.0
        # A fresh Philox seed per call from the current CUDA generator, kept on the device (no host sync).
        # Without dropout the kernel never reads the seed: pass x as a placeholder (no allocation, no launch).
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int32) if dropout else None
        n = x.shape[-1]
        m = x.numel() // n if n else 0
        if m and n:
            grid, tiles, meta = _launch("bda_fwd", m, n, x.device)
            _bias_dropout_add_fwd_kernel[grid](
                x, bias if bias is not None else x, residual, out, seed if dropout else x, m, n, tiles, float(prob),
                scale, HAS_BIAS=bias is not None, DROPOUT=dropout, **meta)
        if dropout:
            ctx.save_for_backward(seed)
        ctx.dropout, ctx.prob, ctx.scale = dropout, float(prob), scale
        ctx.x_dtype, ctx.r_dtype = x.dtype, residual.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.bias_param = bias
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        seed = ctx.saved_tensors[0] if ctx.dropout else None
        dout = dout.contiguous()
        has_bias = ctx.bias_dtype is not None
        n = dout.shape[-1]
        m = dout.numel() // n if n else 0
        write_dx = ctx.dropout or dout.dtype != ctx.x_dtype
        dz = torch.empty(dout.shape, dtype=ctx.x_dtype, device=dout.device) if write_dx else dout
        dbias = None
        if not write_dx:
            # no dropout and no cast: dx is dout itself and the bias gradient a plain column sum, by column_sum
            # (closer to memory bandwidth than PyTorch's dout.sum(0), and than the dropout kernel with
            # WRITE_DX=False, whose partial array is large)
            if has_bias:
                dbias = reduce_into_sink(ctx.bias_param, lambda out, acc: column_sum(dout.reshape(m, n),
                                                                                     ctx.bias_dtype, out, acc))
        elif m and n:
            grid, tiles, meta = _launch("dropout_bwd", m, n, dout.device)
            part = torch.empty((grid[1], n), dtype=torch.float32, device=dout.device) if has_bias else dout
            _dropout_bwd_kernel[grid](dout, dz, part, seed if seed is not None else dout, m, n, tiles, ctx.prob,
                                      ctx.scale, DROPOUT=ctx.dropout, WRITE_DX=write_dx, HAS_BIAS=has_bias, **meta)
            if has_bias:
                dbias = reduce_into_sink(ctx.bias_param,
                                         lambda out, acc: sum_partial_rows(part, ctx.bias_dtype, out, acc))
        elif has_bias:
            dbias = torch.zeros(n, dtype=ctx.bias_dtype, device=dout.device)
        dres = dout if dout.dtype == ctx.r_dtype else dout.to(ctx.r_dtype)
        return dz, dbias, dres, None, None
