"""Activation memory per transformer layer, measured, next to Korthikanti et al.'s formulas.

For each configuration a block of ``--layers`` of our TransformerLayer runs one forward pass and we count the
bytes of every tensor autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``; one count per
storage, parameters excluded), divided by the number of layers. On CUDA the growth of
``torch.cuda.memory_allocated`` across the forward pass is recorded too. Configurations: recompute none /
selective / full (uniform, 1 layer per group), attention backend unfused (the paper's explicit softmax) and sdpa
(flash), tensor parallelism 1 and 2 with and without sequence parallelism (gloo processes on CPU), and FP8 GEMMs
(``--fp8-format hybrid``) without and with selective recomputation.

Paper formulas (bytes per layer, 16-bit activations, 1-byte dropout masks), ``t`` = TP size:
  no parallelism           sbh (34 + 5as/h)
  TP, no SP                sbh (10 + 24/t + 5as/(ht))
  TP + SP                  sbh/t (34 + 5as/h)
  selective recompute      34 sbh/t (with SP; t = 1 without parallelism)
  full recompute           2 sbh (only the layer input; /t with SP)

    python bench/memory.py                 # CPU, writes bench/results/memory.{json,md}
    python bench/memory.py --device cuda   # on the GPU machine (fused kernels, allocator deltas too)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.parallel_state import ParallelState  # noqa: E402
from megatron.core.transformer.block import TransformerBlock  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402


def paper_formula(kind: str, s: int, b: int, h: int, a: int, t: int, sp: bool) -> float:
    """Bytes per layer predicted by the paper for this configuration."""
    sbh = s * b * h
    if kind == "full":
        return 2 * sbh / (t if sp else 1)
    if kind == "selective":
        return 34 * sbh / (t if sp else 1) if (sp or t == 1) else sbh * (10 + 24 / t)
    if t == 1 or sp:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


class SavedBytes:
    """Context manager summing the bytes of distinct storages autograd saves, parameters excluded."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.seen, self.total, self.by_dtype = set(), 0, {}

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if st.nbytes() and ptr not in self.param_ptrs and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += st.nbytes()
            key = str(t.dtype).replace("torch.", "")
            self.by_dtype[key] = self.by_dtype.get(key, 0) + st.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def measure(shape: dict, recompute: str, backend: str, pstate: ParallelState, sp: bool, device: str,
            dropout: float, layers: int, fp8: str = None) -> dict:
    """Forward one block of ``layers`` layers on random input; return saved bytes per layer (and allocator delta)."""
    s, b, h, a = shape["s"], shape["b"], shape["h"], shape["a"]
    tensor_parallel.model_parallel_seed(1234, pstate)
    # PyTorch's CPU flash kernel has no dropout (SDPA would fall back to the math path), so on CPU the sdpa rows
    # run without attention dropout: the flash path is what the GPU runs.
    attn_dropout = 0.0 if (backend == "sdpa" and device == "cpu") else dropout
    cfg = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=a, seq_length=s,
                            attention_dropout=attn_dropout, hidden_dropout=dropout, params_dtype=torch.bfloat16,
                            sequence_parallel=sp, attention_backend=backend,
                            recompute_granularity=None if recompute == "none" else recompute,
                            recompute_method="uniform" if recompute == "full" else None,
                            recompute_num_layers=1 if recompute == "full" else None, fp8=fp8)
    block = TransformerBlock(cfg, pstate, layers, post_layer_norm=False).to(device)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else (p.fill_(1.0) if "layernorm" in name else p.zero_())
    block.train()
    s_local = s // pstate.tp_size if sp else s
    gen = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(s_local, b, h, generator=gen).to(device=device, dtype=torch.bfloat16).requires_grad_()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with SavedBytes(block.parameters()) as counter:
        out = block(x)
    delta = None
    if device == "cuda":
        torch.cuda.synchronize()
        delta = (torch.cuda.memory_allocated() - before - out.numel() * out.element_size()) / layers
    out.float().sum().backward()  # the saved graph must also be usable
    saved = counter.total / layers
    sbh = s * b * h
    t = pstate.tp_size
    predicted = paper_formula(recompute, s, b, h, a, t, sp)
    return {"recompute": recompute, "attention": backend, "tp": t, "sp": sp, "dropout": dropout, "fp8": fp8,
            "saved_bytes_per_layer": saved, "saved_per_sbh": round(saved / sbh, 3),
            "alloc_delta_per_sbh": None if delta is None else round(delta / sbh, 3),
            "paper_per_sbh": round(predicted / sbh, 3), "by_dtype": counter.by_dtype,
            "attention_dropout": attn_dropout}


def _tp_worker(rank, world_size, shape, configs, device, dropout, layers, out_path):
    pstate = ParallelState.build(tensor_model_parallel_size=world_size)
    rows = [measure(shape, rc, be, pstate, sp, device, dropout, layers) for rc, be, sp in configs]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def main() -> None:
    ap = argparse.ArgumentParser(description="Measured activation memory per layer vs the paper's formulas.")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1, help="attention and hidden dropout (paper: 0.1)")
    ap.add_argument("--tp", type=int, default=2, help="TP size for the TP/SP rows (0 to skip; CPU gloo only)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "memory"))
    a = ap.parse_args()
    torch.manual_seed(0)
    shape = {"s": a.seq, "b": a.batch, "h": a.hidden, "a": a.heads}
    single = ParallelState.single()
    rows = []
    for backend in ("unfused", "sdpa"):
        for rc in ("none", "selective", "full"):
            rows.append(measure(shape, rc, backend, single, False, a.device, a.dropout, a.layers))
            print(rows[-1], flush=True)
    for backend, rc in (("unfused", "none"), ("sdpa", "none"), ("sdpa", "selective")):  # --fp8-format hybrid
        rows.append(measure(shape, rc, backend, single, False, a.device, a.dropout, a.layers, fp8="hybrid"))
        print(rows[-1], flush=True)
    if a.tp > 1 and a.device == "cpu":
        import tempfile

        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from dist_utils import run_distributed

        configs = [("none", "unfused", False), ("none", "unfused", True), ("selective", "unfused", True),
                   ("full", "unfused", True), ("none", "sdpa", True)]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "tp.json")
            run_distributed(_tp_worker, a.tp, (shape, configs, "cpu", a.dropout, a.layers, path))
            with open(path) as f:
                rows += json.load(f)
        for r in rows[-len(configs):]:
            print(r, flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
            "shape": shape, "layers": a.layers, "dropout": a.dropout,
            "command": "python bench/memory.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)
    s, b, h, hd = a.seq, a.batch, a.hidden, a.heads
    md = [f"# Activation memory per layer ({meta['device']}, {meta['date']})", "",
          f"s={s}, b={b}, h={h}, a={hd} (5as/h = {5 * hd * s / h:.0f}), bf16 activations, dropout {a.dropout}, "
          f"{a.layers} layers; command `{meta['command']}`.", "",
          "Measured = bytes of the distinct storages autograd saves in one forward pass (parameters excluded), "
          "per layer, divided by s*b*h. Paper = Korthikanti et al. 2022, Table 2 (16-bit activations). The FP8 rows "
          "keep each GEMM input as a 1-byte transposed copy (7 sbh per layer) instead of the 16-bit tensors only "
          "the GEMMs needed (12 sbh: both LayerNorm outputs and the GeLU output; the attention output is kept by "
          "the attention backward anyway), plus the transposed FP8 weights (12h^2 bytes per layer: 3 sbh at this "
          "small h, 1.5 sbh at the 1.3B shape).", "",
          "| recompute | attention | TP | SP | GEMMs | measured / sbh | " +
          ("allocator delta / sbh | " if a.device == "cuda" else "") + "paper / sbh |",
          "|---|---|---|---|---|---|" + ("---|" if a.device == "cuda" else "") + "---|"]
    for r in rows:
        md.append(f"| {r['recompute']} | {r['attention']}{'' if r['attention_dropout'] else ' (no attn dropout)'} | "
                  f"{r['tp']} | {'yes' if r['sp'] else 'no'} | {'fp8 ' + r['fp8'] if r.get('fp8') else 'bf16'} | "
                  f"{r['saved_per_sbh']} | " + (f"{r['alloc_delta_per_sbh']} | " if a.device == "cuda" else "")
                  + f"{r['paper_per_sbh']} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
