"""Is the bias+GeLU kernel bound by memory or by its arithmetic? (GPU only.)

Times, with ``triton.testing.do_bench_cudagraph`` (GPU time), copies of the bias+GeLU forward and backward
kernels of ``megatron/core/fusions/_triton_elementwise.py`` whose math is swapped (MODE): 0 the exact GeLU with
libdevice's erf (the kernels' math before 2026-11-29), 1 no math (z -> y: the memory-bound floor of the same
loop), 2 z * sigmoid(1.702 z) (cheap math, diagnostic only), 3 erf from Abramowitz & Stegun 7.1.26 (one exp, one
reciprocal: the form the kernels use now); each with masks and 64-bit offsets (EVEN=False) or without (EVEN=True),
under several launch configurations (BLOCK_M, BLOCK_N, num_warps, programs per SM), at the FFN shapes of the
benchmark models ([16384, 8192] at 1.3B, [16384, 3072] at 124M). Also prints the max abs error of modes 0 and 3
against float64 over [-8, 8].

    PYTHONPATH=. python bench/experiments/gelu_math.py bench/experiments/results/gelu_math.json
    PYTHONPATH=. python bench/experiments/gelu_math.py --md bench/experiments/results/gelu_math.json OUT.md
"""
import torch, triton, triton.language as tl, json, sys
from triton.testing import do_bench_cudagraph
from megatron.core.fusions._triton_elementwise import gelu_f32, _launch, TILE_CONFIG

@triton.jit
def erf_as(x):
    # Abramowitz-Stegun 7.1.26 style, single branch
    a = tl.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    r = 1.0 - p * tl.exp(-a * a)
    return tl.where(x < 0, -r, r)

@triton.jit
def math_fwd(z, MODE: tl.constexpr):
    if MODE == 0:
        return gelu_f32(z)
    elif MODE == 1:
        return z
    elif MODE == 2:
        return z * tl.sigmoid(1.702 * z)
    else:
        return 0.5 * z * (1.0 + erf_as(z * 0.7071067811865476))

@triton.jit
def fwd_kernel(X, B, Y, M, N, ROW_TILES, MODE: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    for t in range(0, ROW_TILES):
        rows = (tl.program_id(1) * ROW_TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        if EVEN:
            offs = rows[:, None] * N + cols[None, :]
            z = tl.load(X + offs).to(tl.float32) + b[None, :]
            tl.store(Y + offs, math_fwd(z, MODE).to(Y.dtype.element_ty))
        else:
            mask = (rows < M)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
            tl.store(Y + offs, math_fwd(z, MODE).to(Y.dtype.element_ty), mask=mask)

@triton.jit
def bwd_kernel(DY, X, B, DX, DB_PART, M, N, ROW_TILES, MODE: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for t in range(0, ROW_TILES):
        rows = (tl.program_id(1) * ROW_TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        if EVEN:
            offs = rows[:, None] * N + cols[None, :]
            z = tl.load(X + offs).to(tl.float32) + b[None, :]
            dy = tl.load(DY + offs).to(tl.float32)
        else:
            mask = (rows < M)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
            dx = dy * (cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327)
        elif MODE == 1:
            dx = dy * z
        elif MODE == 2:
            s = tl.sigmoid(1.702 * z)
            dx = dy * (s + 1.702 * z * s * (1.0 - s))
        else:
            e = tl.exp(-0.5 * z * z)
            cdf = 0.5 * (1.0 + erf_as(z * 0.7071067811865476))
            dx = dy * (cdf + z * e * 0.3989422804014327)
        if EVEN:
            tl.store(DX + offs, dx.to(DX.dtype.element_ty))
            acc += dx
        else:
            dx = tl.where(mask, dx, 0.0)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            acc += dx
    tl.store(DB_PART + tl.program_id(1) * N + cols, tl.sum(acc, axis=0), mask=cmask)

def write_md(json_path, md_path):
    rows = json.load(open(json_path))
    out = ["# bias+GeLU kernel: memory or math? (`bench/gelu_math.py`)", "",
           "GPU time per call (do_bench_cudagraph), bf16, TB/s = bytes read + written / time. MODE 0: libdevice erf (the",
           "old kernels), 1: no math (floor), 2: sigmoid GeLU (diagnostic), 3: A&S 7.1.26 erf (the kernels now).", "",
           "| shape | kernel | config (BLOCK_M, BLOCK_N, warps, programs/SM) | mode | unmasked | us | TB/s |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['kind']} | {r['cfg']} | {r['mode']} | {r['even']} | "
                   f"{r['us']:.1f} | {r['tbs']:.2f} |")
    open(md_path, "w").write("\n".join(out) + "\n")


if len(sys.argv) > 2 and sys.argv[1] == "--md":
    write_md(sys.argv[2], sys.argv[3])
    sys.exit(0)

res = []
for (m, n) in [(16384, 8192), (16384, 3072)]:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2
    dy = torch.randn_like(x)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    gbytes = x.numel() * 2 / 1e9
    for cfg_name in ["cur", (8, 256, 4, 64), (16, 256, 8, 32), (32, 128, 8, 16), (8, 512, 8, 32), (4, 1024, 4, 32)]:
        for kind in ["fwd", "bwd"]:
            key = "gelu_fwd" if kind == "fwd" else "gelu_bwd"
            saved = TILE_CONFIG[key]
            if cfg_name != "cur":
                TILE_CONFIG[key] = cfg_name
            grid, tiles, meta = _launch(key, m, n, x.device)
            TILE_CONFIG[key] = saved
            even = (grid[1] * tiles * meta["BLOCK_M"] == m and n % meta["BLOCK_N"] == 0)
            part = torch.empty(grid[1], n, device="cuda", dtype=torch.float32)
            for mode in [0, 1, 2, 3]:
                for ev in ([False, True] if even else [False]):
                    if kind == "fwd":
                        fn = lambda: fwd_kernel[grid](x, b, y, m, n, tiles, MODE=mode, EVEN=ev, **meta)
                        nbytes = 2 * gbytes
                    else:
                        fn = lambda: bwd_kernel[grid](dy, x, b, y, part, m, n, tiles, MODE=mode, EVEN=ev, **meta)
                        nbytes = 3 * gbytes
                    ms = do_bench_cudagraph(fn, rep=30)
                    r = dict(shape=[m, n], kind=kind, cfg=str(cfg_name if cfg_name != "cur" else ("cur", saved)), mode=mode, even=ev, us=ms * 1e3, tbs=nbytes / ms)
                    res.append(r); print(r, flush=True)
# accuracy of erf_as GeLU vs exact
z = torch.linspace(-8, 8, 1 << 20, device="cuda")
out = torch.empty_like(z)
zz = z.view(1024, 1024); oo = out.view(1024, 1024); bb = torch.zeros(1024, device="cuda")
fwd_kernel[(4, 1)](zz, bb, oo, 1024, 1024, 1024 // 8, MODE=3, EVEN=True, BLOCK_M=8, BLOCK_N=256)
ref = torch.nn.functional.gelu(z.double())
print("max abs err erf_as gelu", (out.double() - ref).abs().max().item())
fwd_kernel[(4, 1)](zz, bb, oo, 1024, 1024, 1024 // 8, MODE=0, EVEN=True, BLOCK_M=8, BLOCK_N=256)
print("max abs err libdevice gelu", (out.double() - ref).abs().max().item())
json.dump(res, open(sys.argv[1], "w"), indent=1)
