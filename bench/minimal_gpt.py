"""The "100-line GPT" peer: a plain GPT-2-style model trained with SDPA, bf16 autocast and fused AdamW.

It is the yardstick for our trainer in bench/gpu_throughput.py: what a careful single-file implementation gets
from PyTorch alone, eager or under ``torch.compile``. fp32 parameters, bf16 autocast, causal SDPA (flash
backend), tied input/output embedding, learned positions, pre-LayerNorm, GeLU MLP, no dropout.

    python bench/minimal_gpt.py --layers 12 --hidden 768 --heads 12 --seq 1024 --batch 16 [--compile]
"""

from __future__ import annotations

import argparse
import json
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


def train_and_time(model: nn.Module, step_model, vocab: int, seq: int, batch: int, iters: int, warmup: int,
                   autocast: bool = True) -> dict:
    """Run ``warmup + iters`` AdamW steps on random tokens; return ms/iteration over the timed steps and peak memory.

    ``step_model(idx, targets) -> loss`` is the (possibly compiled) forward. Tokens are drawn once per step on
    the GPU, so no host-to-device copy is timed.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    losses = []
    torch.cuda.reset_peak_memory_stats()
    t0 = None
    for it in range(warmup + iters):
        if it == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        data = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = step_model(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"ms_per_iter": 1000 * elapsed / iters, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "final_loss": losses[-1].item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    with torch.device("cuda"):
        model = MinimalGPT(a.layers, a.hidden, a.heads, a.seq, a.vocab)
    step = torch.compile(model) if a.compile else model
    print(json.dumps(train_and_time(model, step, a.vocab, a.seq, a.batch, a.iters, a.warmup)))


if __name__ == "__main__":
    main()
