"""GPU micro-benchmarks of the fused kernels and of our model alone (forward+backward, no optimizer).

- ``kernels``: each fused op (bias+GeLU, bias+dropout+add, the vocabulary cross-entropy), forward+backward, against
  its eager (and with ``--compiled`` its ``torch.compile``'d) PyTorch reference at the 1.3B shape; writes
  ``bench/experiments/results/gpu_kernels.{json,md}``.
- ``probe SHAPE:VARIANT[:profile]``: our GPTModel alone in one configuration (variants below), with an optional
  profiler table; prints the result. Random tokens: a probe of the model's kernels, not a throughput figure.

    python bench/experiments/kernel_probes.py kernels [--compiled]
    python bench/experiments/kernel_probes.py probe 1.3b:eager-fused:profile
"""

from __future__ import annotations

import json
import os
import time

import argparse
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))
from gpu_throughput import SHAPES, VOCAB, environment  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# kernel micro-benchmark: each fused op against its eager and compiled reference, fwd+bwd
# ---------------------------------------------------------------------------------------------------------------
def run_kernel_bench(results_dir: str, with_compiled: bool = False) -> list:
    import torch
    import triton.testing

    from megatron.core.fusions import ops
    from megatron.core.fusions.cross_entropy import cross_entropy_reference, fused_vocab_cross_entropy

    torch.manual_seed(0)
    s, b, h, dt = 2048, 8, 2048, torch.bfloat16  # the 1.3B shape
    dev = "cuda"

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dt).requires_grad_()

    x4, b4 = leaf(s, b, 4 * h), leaf(4 * h)
    xh, bh, rh = leaf(s, b, h), leaf(h), leaf(s, b, h)
    cases = {
        "bias_gelu [s,b,4h]": ((x4, b4), lambda f: lambda: f(x4, b4), ops.bias_gelu, ops.bias_gelu_reference,
                               3 * x4.numel() * 2),
        "bias_dropout_add p=0 [s,b,h]": ((xh, bh, rh), lambda f: lambda: f(xh, bh, rh, 0.0, True),
                                         ops.bias_dropout_add, ops.bias_dropout_add_reference, 5 * xh.numel() * 2),
        "bias_dropout_add p=0.1 [s,b,h]": ((xh, bh, rh), lambda f: lambda: f(xh, bh, rh, 0.1, True),
                                           ops.bias_dropout_add, ops.bias_dropout_add_reference, 5 * xh.numel() * 2),
    }
    rows = []
    for name, (inputs, mk, fused, ref, min_bytes) in cases.items():
        grad = None
        timings = {}
        variants = [("fused", fused), ("eager", ref)] + ([("compiled", torch.compile(ref))] if with_compiled else [])
        for label, fn in variants:
            call = mk(fn)
            out = call()
            grad = torch.randn_like(out)

            def fwd_bwd(call=call):
                for t in inputs:
                    t.grad = None
                call().backward(grad)

            timings[label] = triton.testing.do_bench(fwd_bwd, warmup=50, rep=300, return_mode="median")
        rows.append({"op": name, **{f"{k}_ms": round(v, 4) for k, v in timings.items()},
                     "floor_ms": round(min_bytes / 4.3e12 * 1e3, 4)})
        print(rows[-1], flush=True)
    # vocabulary cross-entropy: time and peak memory beyond the logits
    v = 50304
    logits0 = torch.randn(s, b, v, device=dev, dtype=dt)
    target = torch.randint(0, v, (s, b), device=dev)
    for label, fn in (("fused", lambda lg: fused_vocab_cross_entropy(lg, target)),
                      ("eager", lambda lg: cross_entropy_reference(lg, target))):
        lg = logits0.clone().requires_grad_()
        def fwd_bwd(lg=lg, fn=fn):
            lg.grad = None
            fn(lg).sum().backward()
        ms = triton.testing.do_bench(fwd_bwd, warmup=5, rep=100, return_mode="median")
        lg.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        rows.append({"op": f"vocab cross-entropy [s,b,V] {label}", f"{label}_ms": round(ms, 3),
                     "extra_peak_gib": round(extra, 3), "floor_ms": round(3 * lg.numel() * 2 / 4.3e12 * 1e3, 4)})
        print(rows[-1], flush=True)
        del lg
    env = environment()
    with open(os.path.join(results_dir, "gpu_kernels.json"), "w") as f:
        json.dump({"env": env, "shape": {"s": s, "b": b, "h": h, "dtype": "bf16"}, "rows": rows}, f, indent=2)
    md = [f"# Fused kernels, forward+backward, median ms ({env['gpu']}, torch {env['torch']}, triton "
          f"{env['triton']})", "", "s=2048, b=8, h=2048, bf16. floor = minimal bytes / 4.3 TB/s.", "",
          "| op | fused | eager reference | compiled reference | floor | extra peak (GiB) |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['op']} | {r.get('fused_ms', '')} | {r.get('eager_ms', '')} | {r.get('compiled_ms', '')} | "
                  f"{r['floor_ms']} | {r.get('extra_peak_gib', '')} |")
    with open(os.path.join(results_dir, "gpu_kernels.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# model probe: our GPTModel alone, forward+backward, in several configurations, plus a profile
# ---------------------------------------------------------------------------------------------------------------
PROBE_VARIANTS = {
    "eager-fused": dict(use_fused_kernels=True, compile=False, fused_ce=True),
    "eager-unfused": dict(use_fused_kernels=False, compile=False, fused_ce=False),
    "compiled": dict(use_fused_kernels=True, compile=True, fused_ce=True),
    "compiled-selective": dict(use_fused_kernels=True, compile=True, fused_ce=True, recompute="selective"),
}


def run_model_probe(shape_name: str, variant: str, iters: int, warmup: int, profile_path: str = "") -> dict:
    """Time our GPTModel's forward+backward (bf16 parameters, no optimizer) on random tokens."""
    import torch

    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import ParallelState
    from megatron.core.transformer.config import TransformerConfig

    v = PROBE_VARIANTS[variant]
    sh = SHAPES[shape_name]
    pstate = ParallelState.single()
    tensor_parallel.model_parallel_seed(1234, pstate)
    cfg = TransformerConfig(num_layers=sh["num_layers"], hidden_size=sh["hidden_size"],
                            num_attention_heads=sh["num_heads"], seq_length=sh["seq_length"],
                            padded_vocab_size=VOCAB, attention_dropout=0.0, hidden_dropout=0.0,
                            params_dtype=torch.bfloat16, use_fused_kernels=v["use_fused_kernels"],
                            recompute_granularity=v.get("recompute"))
    model = GPTModel(cfg, pstate, use_torch_compile=v["compile"], fused_cross_entropy=v["fused_ce"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    b, sq = sh["micro_batch_size"], sh["seq_length"]
    pos = torch.arange(sq, device="cuda").unsqueeze(0).expand(b, sq)

    def step():
        data = torch.randint(0, VOCAB, (b, sq + 1), device="cuda")
        loss = model(data[:, :-1], pos, data[:, 1:].contiguous()).float().mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss

    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t0) / iters
    res = {"variant": variant, "shape": shape_name, "fwd_bwd_ms": round(ms, 2),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    if profile_path:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        with open(profile_path, "w") as f:
            f.write(f"{variant} {shape_name}: {res}\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=80))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="fused ops against their PyTorch references")
    k.add_argument("--compiled", action="store_true", help="also the torch.compile'd references")
    k.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    p = sub.add_parser("probe", help="our GPTModel alone, forward+backward")
    p.add_argument("spec", help=f"SHAPE:VARIANT[:profile], variants: {', '.join(PROBE_VARIANTS)}")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-path", default="profile_probe.txt")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/experiments/kernel_probes.py runs on a GPU: no CUDA device is visible")
    if a.what == "kernels":
        os.makedirs(a.results_dir, exist_ok=True)
        run_kernel_bench(a.results_dir, a.compiled)
        return
    shape, _, rest = a.spec.partition(":")
    variant, _, prof = rest.partition(":")
    if shape not in SHAPES or variant not in PROBE_VARIANTS:
        raise SystemExit(f"probe {a.spec!r}: expected SHAPE:VARIANT[:profile] with SHAPE in {', '.join(SHAPES)} "
                         f"and VARIANT in {', '.join(PROBE_VARIANTS)}")
    print(json.dumps(run_model_probe(shape, variant, a.iters, a.warmup, a.profile_path if prof else "")))


if __name__ == "__main__":
    main()
