"""Time causal self-attention, forward and backward, under each SDPA kernel in our layout, on the GPU.

For the two shapes of bench/gpu_throughput.py (1.3b: b 8, s 2048, 16 heads of 128; 124m: b 16, s 1024, 12 heads
of 64), q, k, v are the strided per-head views of one ``[s, b, n, 3d]`` bf16 QKV tensor, exactly as
``SelfAttention`` passes them. Each backend that runs the inputs is timed with ``triton.testing.do_bench``
(forward alone and forward+backward) and checked against PyTorch's default choice. Writes
``attention_backends.{json,md}`` to the results directory.

    python bench/attention_backends.py [--results-dir bench/results]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import run_meta, write_results  # noqa: E402

SHAPES = {"1.3b": dict(b=8, s=2048, n=16, d=128, layers=24), "124m": dict(b=16, s=1024, n=12, d=64, layers=12)}
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(qkv: torch.Tensor, d: int, kernel) -> torch.Tensor:
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.split(d, dim=-1))  # [b, n, s, d] strided views
    if kernel is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(kernel):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention_backends.py times GPU kernels: no CUDA device is visible")
    from triton.testing import do_bench
    rows = []
    for name, sh in SHAPES.items():
        b, s, n, d = sh["b"], sh["s"], sh["n"], sh["d"]
        torch.manual_seed(0)
        qkv = torch.randn(s, b, n, 3 * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16)
        ref = attention(qkv, d, None).float()
        # causal attention FLOPs actually executed: 2 GEMMs of 2*b*n*s*s*d, halved by the mask; backward 2.5x
        fwd_flops = 2 * 2 * b * n * s * s * d / 2
        for backend, kernel in BACKENDS.items():
            try:
                out = attention(qkv, d, kernel)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                fwd = do_bench(lambda: attention(qkv, d, kernel), rep=100)

                def fwd_bwd():
                    qkv.grad = None
                    attention(qkv, d, kernel).backward(grad)

                both = do_bench(fwd_bwd, rep=100)
            except RuntimeError as e:  # the kernel cannot run these inputs
                rows.append({"shape": name, "backend": backend, "error": str(e).splitlines()[0][:160]})
                print(name, backend, "unavailable:", rows[-1]["error"], flush=True)
                continue
            rows.append({"shape": name, "backend": backend, "fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(both, 4),
                         "fwd_tflops": round(fwd_flops / fwd / 1e9, 1),
                         "fwd_bwd_tflops": round(3.5 * fwd_flops / both / 1e9, 1),
                         "per_iteration_ms": round(both * sh["layers"], 2), "rel_err_vs_default": err})
            print(rows[-1], flush=True)
    md = ["bf16, q/k/v strided views of one [s, b, n, 3d] tensor. TFLOP/s count the causal half only "
          "(backward = 2.5x forward). Per iteration = forward+backward x layers.", "",
          "| shape | backend | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | per iteration ms | rel. err |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['shape']} | {r['backend']} | unavailable: {r['error']} | | | | | |")
        else:
            md.append(f"| {r['shape']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                      f"{r['fwd_tflops']} | {r['fwd_bwd_tflops']} | {r['per_iteration_ms']} | "
                      f"{r['rel_err_vs_default']:.1e} |")
    write_results(a.results_dir, "attention_backends", run_meta("attention_backends.py"), rows,
                  "Causal attention kernels", md)

if __name__ == "__main__":
    main()
