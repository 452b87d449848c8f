"""Time one linear layer's forward+backward in FP8 (megatron/core/fusions/fp8.py) against bf16, on the GPU.

For each GEMM layer of the two model shapes of bench/gpu_throughput.py (tokens = micro-batch x sequence), runs
``y = x W^T`` forward and backward with the weight gradient added into an fp32 ``main_grad`` (as the trainer
does), in bf16 (``linear_with_grad_accumulation_fusion``) and in FP8 hybrid (``fp8_linear``), and times the
pieces of the FP8 path (amax, cast, each GEMM) alone. Writes ``fp8_linear.{json,md}``.

    python bench/experiments/fp8_linear.py [--results-dir bench/experiments/results]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
sys.path.insert(0, os.path.dirname(HERE))  # bench/ (results_io)
from results_io import run_meta, write_results  # noqa: E402

from megatron.core.fusions import fp8  # noqa: E402
from megatron.core.fusions.linear import linear_with_grad_accumulation_fusion  # noqa: E402

LAYERS = {  # name: (tokens, in, out, count per iteration)
    "1.3b qkv": (16384, 2048, 6144, 24), "1.3b proj": (16384, 2048, 2048, 24),
    "1.3b fc1": (16384, 2048, 8192, 24), "1.3b fc2": (16384, 8192, 2048, 24),
    "124m qkv": (16384, 768, 2304, 12), "124m proj": (16384, 768, 768, 12),
    "124m fc1": (16384, 768, 3072, 12), "124m fc2": (16384, 3072, 768, 12),
}


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    rows = []
    for name, (m, k, n, count) in LAYERS.items():
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16().requires_grad_()
        w.main_grad = torch.zeros(n, k, device="cuda")
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

        def bf16_step():
            linear_with_grad_accumulation_fusion(x, w).backward(dy)

        def fp8_step():
            fp8.fp8_linear(x, w, None, "hybrid").backward(dy)

        flops = 6 * m * k * n
        t_bf16, t_fp8 = do_bench(bf16_step, rep=100), do_bench(fp8_step, rep=100)
        xd = x.detach()
        xq, xqt, x_inv = fp8.quantize(xd, fp8.E4M3, 0, transpose=True)
        wq, wqt, w_inv = fp8.quantize(w.detach(), fp8.E4M3, 0, transpose=True)
        dyq, dyqt, dy_inv = fp8.quantize(dy, fp8.E5M2, 0, transpose=True)
        scale, _ = fp8.scales(xd, fp8.E4M3, 0)
        parts = {
            "amax x": do_bench(lambda: fp8.scales(xd, fp8.E4M3, 0)),
            "cast x (+T)": do_bench(lambda: fp8._triton_scaled_cast(xd, scale, fp8.E4M3, True)),
            "fprop gemm": do_bench(lambda: fp8._mm(xq, wq.t(), x_inv, w_inv, torch.bfloat16, fast_accum=True)),
            "dgrad gemm": do_bench(lambda: fp8._mm(dyq, wqt.t(), dy_inv, w_inv, torch.bfloat16)),
            "wgrad gemm": do_bench(lambda: fp8._mm(dyqt, xqt.t(), dy_inv, x_inv, torch.float32)),
            "bf16 fprop gemm": do_bench(lambda: torch.matmul(xd, w.detach().t())),
        }
        rows.append({"layer": name, "tokens": m, "in": k, "out": n, "bf16_ms": round(t_bf16, 4),
                     "fp8_ms": round(t_fp8, 4), "speedup": round(t_bf16 / t_fp8, 3),
                     "bf16_tflops": round(flops / t_bf16 / 1e9, 1), "fp8_tflops": round(flops / t_fp8 / 1e9, 1),
                     "saved_ms_per_iteration": round((t_bf16 - t_fp8) * count, 2),
                     "parts_ms": {p: round(v, 4) for p, v in parts.items()}})
        print(rows[-1], flush=True)
        del w.main_grad
    md = ["Forward + backward of one linear (no bias), weight gradient added into an fp32 main_grad; FP8 = hybrid "
          "with tensorwise current scaling, all casts included. TFLOP/s = 6 x tokens x in x out / time.", "",
          "| layer | bf16 ms | fp8 ms | speedup | bf16 TFLOP/s | fp8 TFLOP/s | saved per iteration ms | "
          "fp8 parts ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = ", ".join(f"{p} {v:.3f}" for p, v in r["parts_ms"].items())
        md.append(f"| {r['layer']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | {r['speedup']:.2f}x | "
                  f"{r['bf16_tflops']} | {r['fp8_tflops']} | {r['saved_ms_per_iteration']} | {parts} |")
    write_results(a.results_dir, "fp8_linear", run_meta("fp8_linear.py"), rows, "FP8 linear layers against bf16", md)

if __name__ == "__main__":
    main()
