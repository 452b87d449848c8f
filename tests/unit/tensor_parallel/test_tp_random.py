"""RNG tracker, model-parallel seeding, checkpointable RNG states and activation recomputation."""

import io
import random
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    checkpoint,
    count_collectives,
    get_all_rng_states,
    get_rng_tracker,
    model_parallel_seed,
    set_all_rng_states,
)
from megatron.core.transformer.config import TransformerConfig
from tests.dist_utils import run_distributed


def test_tracker_fork_swaps_and_advances():
    tr = RNGStatesTracker()
    tr.add("a", 7)
    torch.manual_seed(1)
    plain = torch.rand(3), torch.rand(3)
    torch.manual_seed(1)
    first = torch.rand(3)
    with tr.fork("a"):
        inside1 = torch.rand(3)
    second = torch.rand(3)
    with tr.fork("a"):
        inside2 = torch.rand(3)
    # the default stream is unaffected by the fork, and the forked stream continues where it left off
    assert torch.equal(first, plain[0]) and torch.equal(second, plain[1])
    assert torch.equal(torch.cat([inside1, inside2]), torch.rand(6, generator=torch.Generator().manual_seed(7)))

    saved = tr.get_states()
    with tr.fork("a"):
        x = torch.rand(4)
    tr.set_states(saved)
    with tr.fork("a"):
        assert torch.equal(torch.rand(4), x)

    with pytest.raises(ValueError, match="already tracked"):
        tr.add("a", 8)
    with pytest.raises(ValueError, match="seed 7"):
        tr.add("b", 7)
    with pytest.raises(KeyError, match="not tracked"):
        with tr.fork("missing"):
            pass
    tr.reset()
    assert tr.names() == []


def test_model_parallel_seed_single_process():
    model_parallel_seed(123, ParallelState.single())
    outside = torch.rand(5)
    with get_rng_tracker().fork():
        inside = torch.rand(5)
    assert torch.equal(outside, torch.rand(5, generator=torch.Generator().manual_seed(123)))
    assert torch.equal(inside, torch.rand(5, generator=torch.Generator().manual_seed(123 + 2718)))


def test_all_rng_states_round_trip_weights_only():
    model_parallel_seed(9, ParallelState.single())
    random.random(); np.random.rand(); torch.rand(1)
    states = get_all_rng_states()
    buf = io.BytesIO()
    torch.save(states, buf)

    def draw():
        with get_rng_tracker().fork():
            t = torch.rand(3)
        return random.random(), float(np.random.rand()), np.random.randn(), torch.rand(3), t

    expected = draw()
    draw()  # move every stream on
    buf.seek(0)
    set_all_rng_states(torch.load(buf, weights_only=True))
    got = draw()
    assert got[:3] == expected[:3]
    assert torch.equal(got[3], expected[3]) and torch.equal(got[4], expected[4])


class _Block(nn.Module):
    """Linear -> dropout (default RNG) -> Linear -> dropout (tracked RNG)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x, scale=1.0):
        h = F.dropout(self.a(x), 0.5, training=True)
        with get_rng_tracker().fork():
            h = F.dropout(self.b(h), 0.5, training=True)
        return h * scale, h.sum()


def _run(recompute, x_requires_grad):
    model_parallel_seed(42, ParallelState.single())
    block = _Block()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(x_requires_grad)
    out, total = checkpoint(block, x, 2.0) if recompute else block(x, 2.0)
    (out.pow(2).sum() + total).backward()
    after = torch.rand(2)  # the default stream after backward must not depend on recomputation
    return out.detach(), x.grad, [p.grad for p in block.parameters()], after


@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_checkpoint_recompute_matches_plain(x_requires_grad):
    plain, ckpt = _run(False, x_requires_grad), _run(True, x_requires_grad)
    assert torch.equal(plain[0], ckpt[0])
    if x_requires_grad:
        assert torch.equal(plain[1], ckpt[1])
    else:
        assert ckpt[1] is None
    for gp, gc in zip(plain[2], ckpt[2]):
        assert gc is not None and torch.equal(gp, gc)
    assert torch.equal(plain[3], ckpt[3])


def _cfg(sp):
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, sequence_parallel=sp)


def _mlp_run(ps, sp, recompute):
    """Column -> dropout inside the TP region (tracked RNG) -> Row; returns grads and collective counts."""
    model_parallel_seed(5, ps)
    col = ColumnParallelLinear(8, 16, config=_cfg(sp), pstate=ps)
    row = RowParallelLinear(16, 8, config=_cfg(sp), pstate=ps)
    g = torch.Generator().manual_seed(ps.tp_rank)
    with torch.no_grad():
        for p in (col.weight, col.bias, row.weight, row.bias):
            p.copy_(torch.randn(p.shape, generator=g))
    s_local = 4 // ps.tp_size if sp else 4
    x = torch.randn(s_local, 2, 8, generator=torch.Generator().manual_seed(7 + ps.tp_rank)).requires_grad_(True)

    def fn(t):
        h, _ = col(t)
        with get_rng_tracker().fork():
            h = F.dropout(h, 0.3, training=True)
        return row(h)[0]

    with count_collectives() as counts:
        y = checkpoint(fn, x) if recompute else fn(x)
        y.sum().backward()
    return [y.detach(), x.grad, col.weight.grad, row.weight.grad], counts


def _dist_body(rank, world):
    ps = ParallelState.build(tensor_model_parallel_size=2)  # world 4: two TP groups of 2 (DP = 2)
    model_parallel_seed(11, ps)
    with get_rng_tracker().fork():
        inside = torch.rand(4)
    outside = torch.rand(4)
    both = torch.stack([inside, outside])
    gathered = [torch.empty_like(both) for _ in range(world)]
    dist.all_gather(gathered, both)
    for other in range(world):
        other_tp = other % 2
        same_inside = torch.equal(gathered[other][0], inside)
        assert same_inside == (other_tp == ps.tp_rank)  # per-TP-rank stream inside TP regions
        assert torch.equal(gathered[other][1], outside)  # one stream outside
    assert torch.equal(inside, torch.rand(4, generator=torch.Generator().manual_seed(11 + 2718 + ps.tp_rank)))

    for sp in (False, True):
        plain, plain_counts = _mlp_run(ps, sp, recompute=False)
        ckpt, ckpt_counts = _mlp_run(ps, sp, recompute=True)
        for a, b in zip(plain, ckpt):
            assert torch.equal(a, b)
        # recomputation repeats the forward collectives once more, during backward; under SP the backward also
        # gathers the column layer's kept input shard again
        fwd = Counter(all_gather=1, reduce_scatter=1) if sp else Counter(all_reduce=1)
        bwd = fwd + Counter(all_gather=1) if sp else fwd
        assert plain_counts == fwd + bwd and ckpt_counts == fwd + fwd + bwd


def test_rng_and_recompute_distributed():
    run_distributed(_dist_body, 4)


def test_set_states_keeps_current_cuda_state_when_saved_without_cuda():
    tr = RNGStatesTracker()
    tr.add("a", 3)
    marker = torch.arange(4, dtype=torch.uint8)
    tr._states["a"]["cuda"] = marker  # as if this process had CUDA
    saved_on_cpu = {"a": {"cpu": torch.get_rng_state(), "cuda": None}}
    tr.set_states(saved_on_cpu)
    assert torch.equal(tr.get_states()["a"]["cuda"], marker)
    assert torch.equal(tr.get_states()["a"]["cpu"], saved_on_cpu["a"]["cpu"])
