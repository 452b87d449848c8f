"""Sweep the launch configurations of the tiled Triton element-wise kernels on the GPU.

For each kernel (bias+GeLU forward and backward, bias+dropout+add forward, LayerNorm forward and backward) and
each model shape of bench/gpu_throughput.py, time every candidate configuration with ``triton.testing.do_bench``
and report the best next to the current default, PyTorch eager and the memory-bandwidth floor.

    python bench/kernel_sweep.py [--only elementwise|layer_norm|fp8|colsum|llama] [--out bench/results/kernel_sweep.json]

The defaults live in ``TILE_CONFIG`` (megatron/core/fusions/_triton_elementwise.py), ``LN_CONFIG``
(_triton_layer_norm.py), ``AMAX_CONFIG`` and ``CAST_CONFIG`` (_triton_fp8.py) and ``COLSUM_CONFIG``
(_triton_elementwise.py). ``--only fp8`` sweeps the FP8 amax and cast kernels on the GEMM-input shapes; ``--only
colsum`` the column sum of the bias gradients on the [tokens, hidden] and [tokens, 3 * hidden] gradients of each
shape, next to PyTorch's ``x.sum(0)``; ``--only llama`` the Llama-family kernels next to their eager PyTorch references:
SwiGLU forward and backward (``TILE_CONFIG["swiglu_*"]``) on ``[tokens, 2 * ffn]``, the rotary embedding
(``ROPE_CONFIG``, _triton_rope.py) on the queries ``[s, b, heads, 128]`` and RMSNorm forward and forward + backward
(the LayerNorm kernels' ``LN_CONFIG``, which the sweep reports for RMSNorm but does not choose from). For each configuration table the script prints (and writes at the end of the
Markdown file) the candidate with the lowest summed slowdown over the swept tensors as the assignment to put in
the source, and for the LayerNorm also ``min_width``, the narrowest swept row length at which the chosen
configuration beat PyTorch's LayerNorm (forward + backward). It never edits the library: a new default is a
reviewed change of that line, measured in the trainer (bench/gpu_throughput.py) before it is committed.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"1.3b": (2048 * 8, 2048), "124m": (1024 * 16, 768)}  # (tokens, hidden)
BANDWIDTH = 4.3e12  # bytes/s, measured copy bandwidth of the H200 (docs/performance.md)
TILES = [(16, 256, 4), (8, 256, 4), (32, 256, 8), (16, 512, 8), (8, 512, 4), (16, 128, 4), (32, 128, 4),
         (64, 128, 8), (4, 1024, 4)]
PER_SM = [8, 16, 32, 64]


def bench(fn) -> float:
    """GPU time of one call: replayed from a CUDA graph, so Python and launch overhead (which the trainer hides
    behind the GPU, or removes with --enable-cuda-graph) do not count."""
    from triton.testing import do_bench_cudagraph

    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=50))


def sweep_tiled(name: str, fn) -> dict:
    import megatron.core.fusions._triton_elementwise as E

    default = E.TILE_CONFIG[name]
    results = []
    try:
        for (bm, bn, w), per_sm in itertools.product(TILES, PER_SM):
            E.TILE_CONFIG[name] = (bm, bn, w, per_sm)
            results.append({"config": [bm, bn, w, per_sm], "ms": bench(fn)})
    finally:
        E.TILE_CONFIG[name] = default
    return {"default": list(default), "default_ms": bench(fn), "results": results}


LN_FWD = [(t, w) for t in (1024, 2048, 4096, 8192) for w in (2, 4, 8)]
LN_BWD = [(t, w, p) for t in (1024, 2048, 4096) for w in (4, 8) for p in (1, 2, 4, 8)]


def sweep_ln(key: str, candidates: list, fn) -> dict:
    import megatron.core.fusions._triton_layer_norm as L

    default = L.LN_CONFIG[key]
    results = []
    try:
        for cand in candidates:
            L.LN_CONFIG[key] = cand
            results.append({"config": list(cand), "ms": bench(fn)})
    finally:
        L.LN_CONFIG[key] = default
    return {"default": list(default), "default_ms": bench(fn), "results": results}


def sweep_row(shape_name: str, op: str, sweep: dict, eager_fn, nbytes: int, key) -> dict:
    """The result row of one swept kernel (``sweep`` as ``sweep_tiled`` returns it), timing ``eager_fn`` (the
    PyTorch alternative, or None) too; printed as it is made."""
    best = min(sweep["results"], key=lambda r: r["ms"])
    r = {"shape": shape_name, "op": op, "default": sweep["default"], "default_ms": sweep["default_ms"],
         "best": best["config"], "best_ms": best["ms"], "eager_ms": bench(eager_fn) if eager_fn is not None else None,
         "floor_ms": nbytes / BANDWIDTH * 1e3, "all": sweep["results"], "key": key}
    print(f"{shape_name} {op}: default {r['default']} {r['default_ms']:.4f} ms, best {r['best']} "
          f"{r['best_ms']:.4f} ms, eager {r['eager_ms']}, floor {r['floor_ms']:.4f}", flush=True)
    return r


def run(shape_name: str, only: str = "") -> list:
    from megatron.core.fusions import _triton_elementwise as E
    from megatron.core.fusions._triton_layer_norm import LayerNormFunction

    tokens, h = SHAPES[shape_name]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def add(op, sweep, eager_fn, nbytes, key=None):
        rows.append(sweep_row(shape_name, op, sweep, eager_fn, nbytes, key))

    x = torch.randn(tokens, 4 * h, device=dev, dtype=dt, generator=g)
    b = torch.randn(4 * h, device=dev, dtype=dt, generator=g)
    dy = torch.randn_like(x)
    xh = torch.randn(tokens, h, device=dev, dtype=dt, generator=g)
    r = torch.randn_like(xh)
    bh = torch.randn(h, device=dev, dtype=dt, generator=g)
    w = torch.randn(h, device=dev, dtype=dt, generator=g)
    if only in ("", "elementwise"):
        with torch.no_grad():
            add("bias_gelu fwd [t,4h]", sweep_tiled("gelu_fwd", lambda: E.BiasGeLUFunction.apply(x, b)),
                lambda: F.gelu(x + b), 2 * x.numel() * 2, "TILE_CONFIG:gelu_fwd")
            add("bias_gelu bwd [t,4h]", sweep_tiled("gelu_bwd", lambda: E.bias_gelu_backward(dy, x, b)),
                None, 3 * x.numel() * 2, "TILE_CONFIG:gelu_bwd")
            add("bias_dropout_add fwd p=0 [t,h]",
                sweep_tiled("bda_fwd", lambda: E.BiasDropoutAddFunction.apply(xh, bh, r, 0.0, True)),
                lambda: r + (xh + bh), 3 * xh.numel() * 2, "TILE_CONFIG:bda_fwd")
    if only in ("", "layer_norm"):
        with torch.no_grad():
            add("layer_norm fwd [t,h]",
                sweep_ln("fwd", LN_FWD, lambda: LayerNormFunction.apply(xh, w, bh, 1e-5, False)),
                lambda: F.layer_norm(xh, (h,), w, bh, 1e-5), 2 * xh.numel() * 2)
        xg, wg, bg = xh.clone().requires_grad_(), w.clone().requires_grad_(), bh.clone().requires_grad_()
        dyh = torch.randn_like(xh)

        def ours_fwd_bwd():  # forward inside: a captured backward needs its forward captured too
            torch.autograd.grad(LayerNormFunction.apply(xg, wg, bg, 1e-5, False), (xg, wg, bg), dyh)

        def torch_fwd_bwd():
            torch.autograd.grad(F.layer_norm(xg, (h,), wg, bg, 1e-5), (xg, wg, bg), dyh)

        add("layer_norm fwd+bwd [t,h]", sweep_ln("bwd", LN_BWD, ours_fwd_bwd), torch_fwd_bwd, 5 * xh.numel() * 2)
    return rows


def sweep_dict(module, key: str, candidates: list, fn) -> dict:
    """Time ``fn`` with each candidate dict in ``module.<key>`` (restored afterwards)."""
    cfg = getattr(module, key)
    default = dict(cfg)
    results = []
    try:
        for cand in candidates:
            cfg.clear()
            cfg.update(cand)
            results.append({"config": cand, "ms": bench(fn)})
    finally:
        cfg.clear()
        cfg.update(default)
    return {"default": default, "default_ms": bench(fn), "results": results}


AMAX_CANDIDATES = [{"block": b, "programs_per_sm": p, "num_warps": w}
                   for b in (2048, 4096, 8192, 16384) for p in (2, 4, 8, 16) for w in (4, 8)]
CAST_CANDIDATES = [{"block_m": m, "block_n": n, "num_warps": w}
                   for m, n in ((32, 128), (64, 64), (64, 128), (128, 64), (32, 256), (64, 256), (128, 128))
                   for w in (4, 8)]
FP8_SHAPES = {"1.3b": [(16384, 2048), (16384, 6144), (16384, 8192)], "124m": [(16384, 768), (16384, 3072)]}


def sweep_fp8(shape_name: str) -> list:
    """Time the FP8 amax+scale and cast(+transpose) kernels for every candidate launch configuration on the
    GEMM inputs / output gradients of one model shape."""
    import megatron.core.fusions._triton_fp8 as T

    rows = []
    for m, n in FP8_SHAPES[shape_name]:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        scale, _ = T.scales(x, torch.float8_e4m3fn, 0)
        for key, cands, fn, nbytes in (
                ("AMAX_CONFIG", AMAX_CANDIDATES, lambda: T.scales(x, torch.float8_e4m3fn, 0), 2 * x.numel()),
                ("CAST_CONFIG", CAST_CANDIDATES, lambda: T.scaled_cast(x, scale, torch.float8_e4m3fn, True),
                 4 * x.numel())):
            rows.append(sweep_row(shape_name, f"fp8 {key} [{m},{n}]", sweep_dict(T, key, cands, fn), None, nbytes,
                                  key))
    return rows


COLSUM_CANDIDATES = [{"block_m": m, "block_n": n, "num_warps": w, "programs_per_sm": p}
                     for m in (16, 32, 64) for n in (64, 128, 256, 512) for w in (4, 8) for p in (1, 2, 4, 8)
                     if m * n <= 128 * 32 * w]  # at most 128 fp32 accumulators per thread


def colsum_shapes(shape_name: str) -> list:
    """[tokens, n] of the bias gradients of one model shape: n = hidden (projection, FC2) and 3 * hidden (QKV)."""
    tokens, h = SHAPES[shape_name]
    return [(tokens, h), (tokens, 3 * h)]


def sweep_colsum(shape_name: str) -> list:
    """Time ``column_sum`` (bf16 in and out) for every candidate COLSUM_CONFIG on the bias-gradient shapes of one
    model shape, next to PyTorch's ``x.sum(0)``."""
    import megatron.core.fusions._triton_elementwise as E

    rows = []
    for m, n in colsum_shapes(shape_name):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ref = x.float().sum(0)
        fn = lambda: E.column_sum(x, torch.bfloat16)  # noqa: E731
        default = dict(E.COLSUM_CONFIG)
        results = []
        try:
            for cand in COLSUM_CANDIDATES:
                E.COLSUM_CONFIG.clear()
                E.COLSUM_CONFIG.update(cand)
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    raise RuntimeError(f"column_sum with {cand} on [{m},{n}]: relative error {err}")
                results.append({"config": cand, "ms": bench(fn)})
        finally:
            E.COLSUM_CONFIG.clear()
            E.COLSUM_CONFIG.update(default)
        best = min(results, key=lambda r: r["ms"])
        rows.append({"shape": shape_name, "op": f"colsum [{m},{n}]", "default": default, "default_ms": bench(fn),
                     "best": best["config"], "best_ms": best["ms"], "eager_ms": bench(lambda: x.sum(0)),
                     "floor_ms": m * n * 2 / BANDWIDTH * 1e3, "all": results, "key": "COLSUM_CONFIG"})
        r = rows[-1]
        print(f"{shape_name} {r['op']}: default {r['default_ms']:.4f} ms, best {r['best']} {r['best_ms']:.4f} ms, "
              f"torch {r['eager_ms']:.4f} ms, floor {r['floor_ms']:.4f}", flush=True)
    return rows


def _lowest_summed_slowdown(rows: list, key: str):
    """The config (a dict) of ``key`` whose time divided by the best time, summed over the swept tensors, is
    lowest; None when nothing of ``key`` was swept."""
    score: dict = {}
    for r in (r for r in rows if r.get("key") == key):
        for res in r["all"]:
            k = json.dumps(res["config"])
            score[k] = score.get(k, 0.0) + res["ms"] / r["best_ms"]
    return json.loads(min(score, key=score.get)) if score else None


def choose_colsum(rows: list):
    """The COLSUM_CONFIG with the lowest summed slowdown over all swept bias-gradient shapes (None if none)."""
    return _lowest_summed_slowdown(rows, "COLSUM_CONFIG")


def choose_fp8(rows: list) -> dict:
    """Per FP8 config dict (AMAX_CONFIG, CAST_CONFIG), the candidate with the lowest summed slowdown."""
    chosen = {}
    for key in ("AMAX_CONFIG", "CAST_CONFIG"):
        cfg = _lowest_summed_slowdown(rows, key)
        if cfg is not None:
            chosen[key] = cfg
    return chosen


def config_line(key: str, cfg: dict) -> str:
    """``KEY = {...}``: the source line of a dict configuration."""
    return f"{key} = " + "{" + ", ".join(f'"{k}": {v}' for k, v in cfg.items()) + "}"


def choose_layer_norm(rows: list) -> dict:
    """The LayerNorm configuration with the lowest summed slowdown over the shapes, and the narrowest width at
    which it beats PyTorch's forward + backward. The backward is timed inside forward + backward (the forward at
    its default configuration), so the chosen forward's gain over that default is added back."""
    def score_best(op):
        mine = [r for r in rows if r["op"] == op]
        score: dict = {}
        for r in mine:
            for res in r["all"]:
                score[tuple(res["config"])] = score.get(tuple(res["config"]), 0.0) + res["ms"] / r["best_ms"]
        return mine, min(score, key=score.get)

    fwd_rows, fwd_cfg = score_best("layer_norm fwd [t,h]")
    both_rows, bwd_cfg = score_best("layer_norm fwd+bwd [t,h]")
    total = {}
    for f, fb in zip(fwd_rows, both_rows):
        fwd_ms = next(res["ms"] for res in f["all"] if tuple(res["config"]) == fwd_cfg)
        both_ms = next(res["ms"] for res in fb["all"] if tuple(res["config"]) == bwd_cfg)
        total[f["shape"]] = [both_ms - f["default_ms"] + fwd_ms, fb["eager_ms"]]
    wins = [SHAPES[shape][1] for shape, (ours, torch_ms) in total.items() if ours < torch_ms]
    losses = [SHAPES[shape][1] for shape, (ours, torch_ms) in total.items() if ours >= torch_ms]
    min_width = min(wins) if wins else 10 ** 9
    if losses and wins and max(losses) > min_width:
        min_width = max(losses) + 1  # wins and losses interleave: only trust widths above every loss
    return {"min_width": min_width, "fwd": fwd_cfg, "bwd": bwd_cfg, "per_shape_ms": total}


def layer_norm_line(choice: dict) -> str:
    """The ``LN_CONFIG = {...}`` source line of a LayerNorm choice."""
    return (f'LN_CONFIG = {{"min_width": {choice["min_width"]}, "fwd": {tuple(choice["fwd"])}, '
            f'"bwd": {tuple(choice["bwd"])}}}')


LLAMA_FFN = {"1.3b": 5632, "124m": 2048}  # SwiGLU hidden size of a Llama-shaped model of each width
ROPE_CANDIDATES = [{"block_m": m, "num_warps": w} for m in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8)]


def run_llama(shape_name: str) -> list:
    """Sweep the SwiGLU, rotary-embedding and RMSNorm kernels on one model shape (bf16), next to eager PyTorch."""
    from megatron.core.fusions import _triton_elementwise as E
    from megatron.core.fusions import _triton_rope as R
    from megatron.core.fusions import ops
    from megatron.core.fusions._triton_layer_norm import LayerNormFunction

    tokens, h = SHAPES[shape_name]
    ffn, head_dim, b = LLAMA_FFN[shape_name], 128, 4
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []

    def add(op, sweep, eager_fn, nbytes, key):
        rows.append(sweep_row(shape_name, op, sweep, eager_fn, nbytes, key))

    x = torch.randn(tokens, 2 * ffn, device=dev, dtype=dt)
    dy = torch.randn(tokens, ffn, device=dev, dtype=dt)
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        add("swiglu fwd [t,2f]", sweep_tiled("swiglu_fwd", lambda: E.BiasSwiGLUFunction.apply(x, None)),
            lambda: ops.swiglu_reference(x), 3 * tokens * ffn * 2, "TILE_CONFIG:swiglu_fwd")
    add("swiglu fwd+bwd [t,2f]",
        sweep_tiled("swiglu_bwd", lambda: torch.autograd.grad(E.BiasSwiGLUFunction.apply(xg, None), xg, dy)),
        lambda: torch.autograd.grad(ops.swiglu_reference(xg), xg, dy), 8 * tokens * ffn * 2, "TILE_CONFIG:swiglu_bwd")

    q = torch.randn(tokens // b, b, h // head_dim, head_dim, device=dev, dtype=dt)
    inv = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.float32) / head_dim)
    f = torch.outer(torch.arange(tokens // b, device=dev, dtype=torch.float32), inv)
    freqs = torch.cat((f, f), -1)[:, None, None, :]
    qg = q.clone().requires_grad_()
    dq = torch.randn_like(q)
    add("rope fwd+bwd [s,b,n,128]",
        sweep_dict(R, "ROPE_CONFIG", ROPE_CANDIDATES,
                   lambda: torch.autograd.grad(R.RotaryFunction.apply(qg, freqs, False), qg, dq)),
        lambda: torch.autograd.grad(ops.apply_rotary_pos_emb_reference(qg, freqs), qg, dq), 4 * q.numel() * 2,
        "ROPE_CONFIG")

    xh = torch.randn(tokens, h, device=dev, dtype=dt)
    w = torch.randn(h, device=dev, dtype=dt)
    with torch.no_grad():
        add("rms_norm fwd [t,h]", sweep_ln("fwd", LN_FWD, lambda: LayerNormFunction.apply(xh, w, None, 1e-5, False,
                                                                                            False, True)),
            lambda: ops.rms_norm_reference(xh, w, 1e-5), 2 * xh.numel() * 2, "LN_CONFIG:rms fwd")
    xr, wr = xh.clone().requires_grad_(), w.clone().requires_grad_()
    dyh = torch.randn_like(xh)
    add("rms_norm fwd+bwd [t,h]",
        sweep_ln("bwd", LN_BWD, lambda: torch.autograd.grad(
            LayerNormFunction.apply(xr, wr, None, 1e-5, False, False, True), (xr, wr), dyh)),
        lambda: torch.autograd.grad(ops.rms_norm_reference(xr, wr, 1e-5), (xr, wr), dyh), 5 * xh.numel() * 2,
        "LN_CONFIG:rms bwd")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1.3b,124m")
    p.add_argument("--only", default="", choices=["", "elementwise", "layer_norm", "fp8", "colsum", "llama"],
                   help="sweep only these kernels")
    p.add_argument("--out", default=None, help="JSON path; the Markdown table goes beside it "
                   "(default: bench/results/kernel_sweep[_ONLY].json)")
    a = p.parse_args()
    if a.out is None:
        suffix = {"": "", "elementwise": "", "layer_norm": "_ln", "fp8": "_fp8", "colsum": "_colsum",
                  "llama": "_llama"}[a.only]
        a.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"kernel_sweep{suffix}.json")
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_sweep.py times Triton kernels on a GPU: no CUDA device is visible")
    rows = []
    for shape in a.shapes.split(","):
        if a.only in ("", "elementwise", "layer_norm"):
            rows += run(shape, a.only)
        if a.only in ("", "fp8"):
            rows += sweep_fp8(shape)
        if a.only in ("", "colsum"):
            rows += sweep_colsum(shape)
        if a.only in ("", "llama"):
            rows += run_llama(shape)
    import triton

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": "python bench/kernel_sweep.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Kernel launch sweep ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']})",
             "", f"Command: `{meta['command']}`. GPU ms per call (triton do_bench_cudagraph), bf16; floor = bytes / 4.3 TB/s.",
             "", "| shape | op | default | default ms | best | best ms | eager ms | floor ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eager = f"{r['eager_ms']:.4f}" if r["eager_ms"] is not None else ""
        lines.append(f"| {r['shape']} | {r['op']} | {r['default']} | {r['default_ms']:.4f} | {r['best']} | "
                     f"{r['best_ms']:.4f} | {eager} | {r['floor_ms']:.4f} |")
    best = []  # (source file, the line to put there)
    if a.only in ("", "layer_norm"):
        choice = choose_layer_norm(rows)
        lines += ["", f"LayerNorm, ours vs PyTorch forward+backward ms per shape: {choice['per_shape_ms']}"]
        best.append(("megatron/core/fusions/_triton_layer_norm.py", layer_norm_line(choice)))
    if a.only in ("", "fp8"):
        for key, cfg in choose_fp8(rows).items():
            best.append(("megatron/core/fusions/_triton_fp8.py", config_line(key, cfg)))
    if a.only in ("", "colsum"):
        cfg = choose_colsum(rows)
        if cfg is not None:
            best.append(("megatron/core/fusions/_triton_elementwise.py", config_line("COLSUM_CONFIG", cfg)))
    if a.only in ("", "elementwise"):
        for name in ("gelu_fwd", "gelu_bwd", "bda_fwd"):
            cfg = _lowest_summed_slowdown(rows, f"TILE_CONFIG:{name}")
            if cfg is not None:
                best.append(("megatron/core/fusions/_triton_elementwise.py", f'TILE_CONFIG["{name}"] = {tuple(cfg)}'))
    if a.only in ("", "llama"):
        for name in ("swiglu_fwd", "swiglu_bwd"):
            cfg = _lowest_summed_slowdown(rows, f"TILE_CONFIG:{name}")
            if cfg is not None:
                best.append(("megatron/core/fusions/_triton_elementwise.py", f'TILE_CONFIG["{name}"] = {tuple(cfg)}'))
        cfg = _lowest_summed_slowdown(rows, "ROPE_CONFIG")
        if cfg is not None:
            best.append(("megatron/core/fusions/_triton_rope.py", config_line("ROPE_CONFIG", cfg)))
    lines += ["", "Best configurations (lowest summed slowdown over the swept tensors; the library is not edited):",
              ""] + [f"- `{path}`: `{line}`" for path, line in best]
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
