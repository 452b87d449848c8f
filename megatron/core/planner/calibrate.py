"""Measure the time model's rates on this machine's GPU and write a calibration file (``tools/plan.py --calibrate``).

Measured (under a minute on one GPU): GEMM rates at the sizes of the transformer linears (bf16, and FP8 through
``torch._scaled_mm`` where the GPU has FP8 tensor cores), causal attention forward + backward at head dims 64 and
128 (``scaled_dot_product_attention``), element-wise bandwidth (a fused multiply-add pass over a large tensor),
copy bandwidth (the optimizer pass), the device memory used outside the PyTorch allocator (CUDA context, library
workspaces), and, with two or more GPUs visible, the NCCL all-reduce bus bandwidth.
What cannot be measured in that time (inter-node bandwidth, the fixed overheads and the allocator's
fragmentation, which come from whole training runs) is carried over from a base calibration and listed under
``carried_over``. Also measured: BERT's attention (bidirectional, with a key-padding mask) at head dim 64, and
the host floor of one transformer layer (``overheads.host_ms_per_layer``): forward and backward of the library's
own ``TransformerLayer`` at a tiny size inside the data-parallel wrapper, where the GPU waits for the Python and
kernel-launch work, so the time is that work's; a small model or micro-batch cannot run faster than it.
The GEMM tables the time model reads (``gemm_tflops``) are derived from the measured ones (kept under
``gemm_tflops_measured``) by the rules of ``derive_gemm_tables``: the running maximum over sizes, and FP8 at
least the bf16 rate.
``device="cpu"`` runs the same code on the CPU (small sizes) to try the routine out; ``quick`` shortens every
timing loop (a smoke test of the routine, not a calibration to keep).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F


BUDGET_SCALE = {"value": 1.0}  # quick mode: every timing loop shortened


def _timeit(fn: Callable[[], None], device: torch.device, budget_s: float = 1.0, max_iters: int = 50) -> float:
    """Median seconds of ``fn`` after a warm-up, within about ``budget_s``."""
    budget_s *= BUDGET_SCALE["value"]
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < max_iters and (time.perf_counter() - start < budget_s or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure_gemm(device: torch.device, tokens: int, sizes: List[tuple], dtype: torch.dtype) -> List[List[float]]:
    """``[[flops, TFLOP/s], ...]`` of ``[tokens, k] x [k, n]`` for each ``(n, k)``."""
    out = []
    for n, k in sizes:
        a = torch.randn(tokens, k, device=device, dtype=dtype)
        b = torch.randn(n, k, device=device, dtype=dtype)
        sec = _timeit(lambda: torch.matmul(a, b.t()), device, budget_s=0.3)
        flops = 2.0 * tokens * n * k
        out.append([flops, flops / sec / 1e12])
    return out


def fp8_supported(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def measure_fp8_gemm(device: torch.device, tokens: int, sizes: List[tuple]) -> List[List[float]]:
    """FP8 forward GEMM rates plus the per-call cost of scaling and casting both operands (tensorwise)."""
    out = []
    one = torch.ones((), device=device)
    for n, k in sizes:
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)

        def step():
            xs, ws = x.abs().amax(), w.abs().amax()
            xq = (x * (448.0 / xs)).to(torch.float8_e4m3fn)
            wq = (w * (448.0 / ws)).to(torch.float8_e4m3fn)
            torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        sec = _timeit(step, device, budget_s=0.3)
        flops = 2.0 * tokens * n * k
        out.append([flops, flops / sec / 1e12])
    return out


def measure_attention(device: torch.device, batch: int, seq: int, heads_by_dim: Dict[int, int]) -> Dict[str, float]:
    """Causal attention forward + backward TFLOP/s (causal half counted; backward = 2.5x forward)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {}
    for d, n in heads_by_dim.items():
        q, k, v = (torch.randn(batch, n, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, n, seq, d, device=device, dtype=dtype)

        def step():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(grad)

        sec = _timeit(step, device, budget_s=1.0)
        fwd_flops = 2.0 * seq * seq * batch * n * d  # QK^T and xV, causal half
        out[str(d)] = 3.5 * fwd_flops / sec / 1e12
    return out


def measure_masked_attention(device: torch.device, batch: int, seq: int, heads: int, dim: int) -> Dict[str, float]:
    """BERT's attention: bidirectional with a boolean key-padding mask ``[b, 1, 1, s]`` (a quarter of the keys
    masked), forward + backward TFLOP/s with the whole s x s square counted."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)
    keep = torch.ones(batch, 1, 1, seq, device=device, dtype=torch.bool)
    keep[..., 3 * seq // 4:] = False  # padded keys

    def step():
        F.scaled_dot_product_attention(q, k, v, attn_mask=keep).backward(grad)

    sec = _timeit(step, device, budget_s=1.0)
    return {str(dim): 3.5 * 4.0 * seq * seq * batch * heads * dim / sec / 1e12}


def measure_elementwise(device: torch.device, numel: int) -> Dict[str, float]:
    """GB/s of a fused multiply-add (read 2, write 1 tensors of 16-bit) and of a plain copy (fp32)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, y = torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype)
    out = torch.empty_like(x)
    sec = _timeit(lambda: torch.addcmul(x, x, y, out=out), device)
    ew = 3 * numel * x.element_size() / sec / 1e9
    a = torch.randn(numel, device=device)
    b = torch.empty_like(a)
    sec = _timeit(lambda: b.copy_(a), device)
    return {"elementwise_gbps": ew, "hbm_gbps": 2 * numel * 4 / sec / 1e9}


def measure_host_floor(device: torch.device, fp8: bool, num_layers: int = 4) -> float:
    """Milliseconds per layer of forward + backward through ``num_layers`` tiny ``TransformerLayer``s (h 64, s 64,
    b 1) as the trainer runs them: fused kernels, inside the data-parallel wrapper whose gradient buffer the
    weight-gradient GEMMs write into (gradient-accumulation fusion); the host's Python and launch work per layer."""
    from megatron.core.distributed import DDPConfig, DistributedDataParallel
    from megatron.core.parallel_state import ParallelState
    from megatron.core.transformer.config import TransformerConfig
    from megatron.core.transformer.layer import TransformerLayer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4, seq_length=64,
                            params_dtype=dtype, attention_dropout=0.0, hidden_dropout=0.0,
                            fp8="hybrid" if fp8 else None)
    pstate = ParallelState.single()
    with torch.device(device):
        layers = torch.nn.Sequential(*[TransformerLayer(cfg, pstate) for _ in range(num_layers)])
    model = DistributedDataParallel(layers, pstate=pstate, config=DDPConfig())
    x = torch.randn(64, 1, 64, device=device, dtype=dtype, requires_grad=True)  # [s, b, h]

    def step():
        model.zero_grad_buffer()
        model(x).sum().backward()

    return 1e3 * _timeit(step, device, budget_s=1.0) / num_layers


def _allreduce_worker(rank: int, world: int, port: int, numel: int, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    t = torch.ones(numel, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    iters = 10
    for _ in range(iters):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    sec = (time.perf_counter() - t0) / iters
    if rank == 0:
        busbw = 2 * (world - 1) / world * numel * 2 / sec / 1e9
        with open(result_path, "w") as f:
            json.dump({"busbw_gbps": busbw}, f)
    dist.destroy_process_group()


def measure_allreduce(num_gpus: int, numel: int = 64 * 2 ** 20) -> Optional[float]:
    """NCCL all-reduce bus bandwidth (GB/s) across ``num_gpus`` local GPUs; None with fewer than two."""
    if num_gpus < 2:
        return None
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ar.json")
        mp.start_processes(_allreduce_worker, args=(num_gpus, port, numel, path), nprocs=num_gpus, join=True,
                           start_method="spawn")
        with open(path) as f:
            return json.load(f)["busbw_gbps"]


def derive_gemm_tables(measured: Dict[str, List[List[float]]]) -> Dict[str, List[List[float]]]:
    """The GEMM tables the time model reads, from the measured ``[[FLOPs, TFLOP/s], ...]`` by two rules.

    1. Envelope: a GEMM runs at least at the best rate measured for any smaller GEMM of the same precision (the
       running maximum over FLOPs). Random N(0, 1) operands make the GPU draw more power than training data and
       lower its clocks by an amount that varies from shape to shape; a larger GEMM is not less efficient.
    2. FP8 floor: an FP8 GEMM runs at least at the bf16 rate of the same size. The measured FP8 step casts both
       operands on every call with unfused amax/scale/cast kernels, while the trainer's FP8 linear quantizes with
       fused kernels and reuses each cast operand in two of its three GEMMs.
    """
    def envelope(points):
        out, best = [], 0.0
        for flops, rate in sorted(points):
            best = max(best, rate)
            out.append([flops, best])
        return out

    tables = {k: envelope(v) for k, v in measured.items()}
    if "fp8" in tables and "bf16" in tables:
        from megatron.core.planner.timing import interp
        tables["fp8"] = envelope([[x, max(r, interp(tables["bf16"], x))] for x, r in tables["fp8"]])
    return tables


GEMM_RULES = ("gemm_tflops: derive_gemm_tables(gemm_tflops_measured), the running maximum over FLOPs per "
              "precision, and FP8 at least the bf16 rate of the same FLOPs (megatron/core/planner/calibrate.py)")


def calibrate(base: dict, device: str = "cuda", gpu_kind: Optional[str] = None, log=print,
              quick: bool = False) -> dict:
    """A calibration measured on ``device``; the entries not measurable here come from ``base``."""
    BUDGET_SCALE["value"] = 0.05 if quick else 1.0
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--calibrate needs a CUDA GPU (or --calibrate-device cpu to try the routine on the CPU)")
    big = dev.type == "cuda"
    # (tokens, hidden sizes): large microbatches at three widths, and small ones (124M at 1 x 1024 tokens,
    # BERT-large at 8 x 512) where the GEMMs are too small to fill the GPU
    shapes = [(16384, [768, 2048, 4096]), (1024, [768]), (4096, [1024])] if big else [(256, [64, 128])]
    t_start = time.perf_counter()
    cal = copy.deepcopy({k: v for k, v in base.items() if not k.startswith("_")})
    name = gpu_kind or (torch.cuda.get_device_name(dev) if big else "cpu")
    log(f"calibrating on {name}: GEMMs (bf16, and FP8 where the GPU has it)")
    cal["gpu_kind"] = name
    bf16, fp8 = [], []
    for tokens, hs in shapes:
        sizes = [(n, k) for h in hs for n, k in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h))]
        bf16 += measure_gemm(dev, tokens, sizes, torch.bfloat16 if big else torch.float32)
        fp8 += measure_fp8_gemm(dev, tokens, sizes) if fp8_supported(dev) else []
    measured = {"bf16": sorted(bf16), "fp8": sorted(fp8) if fp8 else sorted(bf16)}
    cal["gemm_tflops_measured"] = measured
    cal["gemm_tflops"] = derive_gemm_tables(measured)
    log("attention")
    cal["attention_tflops"] = measure_attention(dev, 4 if big else 1, 2048 if big else 128,
                                                {64: 12 if big else 2, 128: 16 if big else 2})
    cal["attention_masked_tflops"] = measure_masked_attention(dev, 8 if big else 1, 512 if big else 64,
                                                              16 if big else 2, 64)
    log("element-wise bandwidth")
    cal.update(measure_elementwise(dev, (256 if big else 4) * 2 ** 20))
    log("host floor per transformer layer")
    host = {"bf16": measure_host_floor(dev, fp8=False)}
    host["fp8"] = measure_host_floor(dev, fp8=True) if fp8_supported(dev) else host["bf16"]
    cal["overheads"]["host_ms_per_layer"] = {k: round(v, 4) for k, v in host.items()}
    carried = ["inter_node_busbw_gbps", "overheads.per_iteration_ms", "overheads.per_microbatch_ms",
               "overheads.per_layer_ms", "overheads.host_recompute_fraction", "overheads.host_ms_per_microbatch",
               "memory.reserved_over_allocated", "memory.nccl_buffer_bytes", "peak_tflops"]
    if big:  # CUDA context and library workspaces: device memory in use that the PyTorch allocator does not hold
        free, total = torch.cuda.mem_get_info(dev)
        cal["memory"]["outside_allocator_bytes"] = float(total - free - torch.cuda.memory_reserved(dev))
        cal["gpu_memory_gb"] = total / 1e9
    else:
        carried.append("memory.outside_allocator_bytes")
    n_gpu = torch.cuda.device_count() if big else 0
    busbw = measure_allreduce(min(n_gpu, 8)) if n_gpu >= 2 else None
    if busbw is not None:
        log(f"NCCL all-reduce over {min(n_gpu, 8)} GPUs: {busbw:.0f} GB/s bus bandwidth")
        cal["collectives"]["intra_node_busbw_gbps"] = busbw
    else:
        carried.append("intra_node_busbw_gbps")
    cal["description"] = (f"measured by tools/plan.py --calibrate on {name} at "
                          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC in "
                          f"{time.perf_counter() - t_start:.0f} s; the entries under carried_over come from "
                          f"{base.get('_path', base.get('gpu_kind'))}")
    cal["carried_over"] = carried
    cal["torch"] = torch.__version__
    cal.pop("sources", None)
    cal["derivation"] = {"gemm_tflops": GEMM_RULES,
                         "measured": "every entry not under carried_over, by the routines of this module"}
    return cal
