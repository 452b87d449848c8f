"""The "100-line GPT" peer: a plain GPT-2-style model trained with SDPA, bf16 autocast and fused AdamW.

It is the yardstick for our trainer in bench/gpu_throughput.py: what a careful single-file implementation gets
from PyTorch alone, eager or under ``torch.compile``. fp32 parameters, bf16 autocast, causal SDPA (flash
backend), tied input/output embedding, learned positions, pre-LayerNorm, GeLU MLP, no dropout. It trains on the
tokens our trainer reads (``bench/corpus.py``: the same .bin/.idx through the library's dataset and loader).

    python bench/minimal_gpt.py --layers 12 --hidden 768 --heads 12 --seq 1024 --batch 16 [--compile]
    python bench/minimal_gpt.py --device cpu --layers 2 --hidden 64 --heads 4 --seq 64 --batch 2 --iters 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)  # each [b, s, h]
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))  # [b, n, s, d]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n, s, d]
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MinimalGPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # [b, s, h]
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # [b, s, V], tied
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def train_and_time(model: nn.Module, step_model, batches, iters: int, warmup: int, autocast: bool = True,
                   loss_of_batch=None, adamw: dict = None, label: str = None) -> dict:
    """Run ``warmup + iters`` AdamW steps on the micro-batches of ``batches``; return ms/iteration over the timed
    steps, the peak memory (CUDA) and the losses.

    ``step_model(idx, targets) -> loss`` is the (possibly compiled) forward; ``batches`` yields
    ``{"text": int64[b, s + 1]}`` (``bench/corpus.py``), copied to the device inside the loop as our trainer does.
    Other models pass ``loss_of_batch(batch) -> loss`` instead, called with every field of the batch on the device;
    ``adamw`` overrides the optimizer settings (lr 1e-4, betas (0.9, 0.95), weight decay 0.1); ``label`` prints a
    progress line per iteration (when the step is queued: no synchronisation).
    """
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    settings = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, **(adamw or {})}
    opt = torch.optim.AdamW(model.parameters(), fused=cuda, **settings)
    losses = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = None
    for it in range(warmup + iters):
        if it == warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        batch = next(batches)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast and cuda):
            if loss_of_batch is None:
                text = batch["text"].to(device, non_blocking=True)  # [b, s + 1]
                idx, targets = text[:, :-1].contiguous(), text[:, 1:].contiguous()  # [b, s] each
                loss = step_model(idx, targets)
            else:
                loss = loss_of_batch({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if label:
            print(f"{label} iteration {it + 1}/{warmup + iters}{' (warm-up)' if it < warmup else ''}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"ms_per_iter": 1000 * elapsed / iters,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "losses": [x.item() for x in losses]}


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from corpus import batches, prepare_dataset
    from gpu_throughput import ours_flags

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304, help="embedding rows (GPT-2's 50,257 padded to 128)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    ap.add_argument("--compile", action="store_true", help="train under torch.compile")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: fp32, a check of the script")
    ap.add_argument("--data-prefix", default=None, help=".bin/.idx prefix (default: tokenise the bundled corpus)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (use --device cpu for a check of the script)")
    torch.backends.cuda.matmul.allow_tf32 = True
    prefix = a.data_prefix or prepare_dataset(tempfile.mkdtemp(prefix="bench_data_"))
    # the micro-batches pretrain_gpt.py reads at this shape and batch size
    shape = dict(num_layers=a.layers, hidden_size=a.hidden, num_heads=a.heads, seq_length=a.seq,
                 micro_batch_size=a.batch)
    data = batches(ours_flags(shape, a.iters, a.warmup, prefix))
    with torch.device(a.device):
        model = MinimalGPT(a.layers, a.hidden, a.heads, a.seq, a.vocab)
    step = torch.compile(model) if a.compile else model
    print(json.dumps(train_and_time(model, step, data, a.iters, a.warmup)))


if __name__ == "__main__":
    main()
