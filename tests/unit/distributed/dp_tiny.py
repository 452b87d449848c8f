"""A tiny model, a deterministic global batch, and a single-process reference trainer for DP parity tests."""

from __future__ import annotations

import torch

IN, HID, OUT = 16, 32, 8
GLOBAL_BATCH = 8


class Tiny(torch.nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear -> LayerNorm -> Linear (fp32, no dropout)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HID)
        self.norm1 = torch.nn.LayerNorm(HID)
        self.fc2 = torch.nn.Linear(HID, HID)
        self.norm2 = torch.nn.LayerNorm(HID)
        self.head = torch.nn.Linear(HID, OUT)

    def forward(self, x):  # x [b, IN] -> [b, OUT]
        h = torch.nn.functional.gelu(self.norm1(self.fc1(x)))
        return self.head(self.norm2(self.fc2(h)))


def make_model(seed: int = 1234, dtype=torch.float32) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    with torch.no_grad():  # non-trivial norm params so their grads and decay matter
        for m in (model.norm1, model.norm2):
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.1, 0.1)
    return model.to(dtype)


def global_batch(step: int):
    """(x [GLOBAL_BATCH, IN], y [GLOBAL_BATCH, OUT]) for iteration ``step``, identical in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def loss_fn(out, y):
    return (out.float() - y).pow(2).mean()


def reference_run(steps: int, lr=1e-2, wd=0.1, clip=0.5, start_step: int = 0, model=None, opt=None):
    """Single-process AdamW on the full global batch; returns (model, optimizer, [grad norms])."""
    model = model if model is not None else make_model()
    if opt is None:
        decay = [p for p in model.parameters() if p.dim() > 1]
        no_decay = [p for p in model.parameters() if p.dim() <= 1]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, betas=(0.9, 0.999), eps=1e-8)
    norms = []
    for step in range(start_step, start_step + steps):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return model, opt, norms


def dp_train(ddp, opt, pstate, steps: int, microbatches: int, start_step: int = 0, check_overlap=None):
    """Train ``steps`` iterations on this DP rank's share of each global batch; returns the grad norms.

    Each microbatch loss is its mean divided by ``microbatches`` (as the schedule does); all but the last
    microbatch run under ``no_sync``. ``check_overlap(ddp, phase)`` is called after the no-sync microbatches
    (``"accumulated"``) and after the last backward (``"last"``).
    """
    from megatron.core.distributed import finalize_model_grads

    dp, rank = pstate.dp_size, pstate.dp_rank
    local = GLOBAL_BATCH // dp
    micro = local // microbatches
    norms = []
    for step in range(start_step, start_step + steps):
        x, y = global_batch(step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        opt.zero_grad()
        for m in range(microbatches):
            xs, ys = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
            if m < microbatches - 1:
                with ddp.no_sync():
                    opt.scale_loss(loss_fn(ddp(xs), ys) / microbatches).backward()
            else:
                if check_overlap is not None:
                    check_overlap(ddp, "accumulated")
                opt.scale_loss(loss_fn(ddp(xs), ys) / microbatches).backward()
                if check_overlap is not None:
                    check_overlap(ddp, "last")
        finalize_model_grads([ddp], pstate)
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    return norms
