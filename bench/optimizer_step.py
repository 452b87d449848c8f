"""Time one mixed-precision AdamW step on the GPU: torch's fused AdamW + the copy into the bf16 params, against
the Triton AdamW that writes the bf16 params in its update (megatron/core/optimizer/fused_adamw.py).

The parameters have the shapes of the two GPTs of bench/gpu_throughput.py (``param_shapes``): fp32 main params,
fp32 grads, bf16 model params, two param groups (>= 2-D weights decayed, the rest not), clipping folded into the
update (``grad_scale``) as the trainer does. GPU time per step from CUDA graphs
(``triton.testing.do_bench_cudagraph``, so both optimizers are built capturable, as under --enable-cuda-graph).
Writes ``optimizer_step.{json,md}``.

    python bench/optimizer_step.py [--results-dir bench/results]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import run_meta, write_results  # noqa: E402

SHAPES = {"1.3b": (24, 2048, 16, 2048), "124m": (12, 768, 12, 1024)}  # layers, hidden, heads, seq
VOCAB = 50304
BANDWIDTH = 4.3e12  # bytes/s, the H200's measured copy bandwidth (docs/performance.md)


def param_shapes(layers: int, hidden: int, seq: int) -> list:
    """The GPT's parameter shapes: tied word embedding, learned positions, per layer two LayerNorms, QKV,
    projection, FC1 and FC2 with biases, and the final LayerNorm."""
    per_layer = [(hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
                 (hidden,), (hidden,), (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]
    return [(VOCAB, hidden), (seq, hidden)] + per_layer * layers + [(hidden,), (hidden,)]


def _make_step(impl: str, groups: list, mains: list, models: list, hyper: dict):
    """One optimizer step of ``impl`` with clipping folded in (grad_scale), as the trainer runs it."""
    from megatron.core.optimizer.fused_adamw import FusedAdamW

    scale = torch.tensor(1.5, device="cuda")
    if impl.startswith("torch"):
        opt = torch.optim.AdamW(groups, fused=True, capturable=True, **hyper)

        def step():
            opt.grad_scale = scale
            opt.step()
            torch._foreach_copy_(models, [m.detach() for m in mains])
    else:
        opt = FusedAdamW(groups, capturable=True, **hyper)
        opt.set_model_params(zip(mains, models))

        def step():
            opt.grad_scale = scale
            opt.step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/optimizer_step.py times GPU kernels: no CUDA device is visible")
    from triton.testing import do_bench_cudagraph
    rows = []
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    for name, (layers, hidden, _, seq) in SHAPES.items():
        shapes = param_shapes(layers, hidden, seq)
        numel = sum(torch.Size(s).numel() for s in shapes)
        results = {}
        for impl in ("torch fused AdamW + copy", "FusedAdamW (Triton, writes bf16)"):
            mains = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
            models = [m.detach().to(torch.bfloat16) for m in mains]
            for m in mains:
                m.grad = torch.randn_like(m) * 1e-3
            groups = [{"params": [m for m in mains if m.dim() > 1], "weight_decay": 0.1},
                      {"params": [m for m in mains if m.dim() <= 1], "weight_decay": 0.0}]
            step = _make_step(impl, groups, mains, models, hyper)
            step()  # state, launch tables, compilation
            torch.cuda.synchronize()
            results[impl] = float(do_bench_cudagraph(step, rep=100))
            del step, mains, models, groups
            torch.cuda.empty_cache()
        torch_ms, ours_ms = results.values()
        floor_ms = numel * (28 + 2) / BANDWIDTH * 1e3  # read p g m v, write p m v (fp32) + the bf16 copy
        rows.append({"shape": name, "params": numel, "torch_ms": round(torch_ms, 3), "ours_ms": round(ours_ms, 3),
                     "floor_ms": round(floor_ms, 3), "speedup": round(torch_ms / ours_ms, 3)})
        print(rows[-1], flush=True)
    body = ["Per mixed-precision AdamW step (fp32 main params and grads, bf16 model params), GPU time from CUDA "
            "graphs. floor = 30 bytes per parameter / 4.3 TB/s.", "",
            "| shape | parameters | torch fused AdamW + foreach copy ms | FusedAdamW ms | speedup | floor ms |",
            "|---|---|---|---|---|---|"]
    body += [f"| {r['shape']} | {r['params']:,} | {r['torch_ms']} | {r['ours_ms']} | {r['speedup']}x | "
             f"{r['floor_ms']} |" for r in rows]
    write_results(a.results_dir, "optimizer_step", run_meta("optimizer_step.py"), rows,
                  "Mixed-precision AdamW step", body)


if __name__ == "__main__":
    main()
