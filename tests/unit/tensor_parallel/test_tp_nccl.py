"""The CUDA path of the tensor-parallel primitives: CUDA RNG states and bf16 layers on one GPU, and the NCCL
collectives (native all_gather_into_tensor / reduce_scatter_tensor) on two. Skipped without the GPUs; the gloo
tests cover the same math on CPU."""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    broadcast_data,
    checkpoint,
    count_collectives,
    get_rng_tracker,
    model_parallel_seed,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel import mappings as M
from megatron.core.transformer.config import TransformerConfig
from tests.dist_utils import run_distributed

WORLD = 2
S, B, H, FFN, V = 8, 2, 16, 32, 24


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).cuda()


def _body(rank, world_size):
    ps = ParallelState.build(tensor_model_parallel_size=WORLD)
    g, r = ps.tp_group, ps.tp_rank
    close = dict(rtol=1e-5, atol=1e-5)

    # dim-0 pair: all-gather / reduce-scatter through the native NCCL collectives
    parts = [_rand(q, S, B, H) for q in range(WORLD)]
    x = parts[r].clone().requires_grad_(True)
    y = M.reduce_scatter_to_sequence_parallel_region(x, g)
    torch.testing.assert_close(y, sum(parts).chunk(WORLD, 0)[r], **close)
    z = M.gather_from_sequence_parallel_region(y, g)
    torch.testing.assert_close(z, sum(parts), **close)
    z.backward(parts[r])
    torch.testing.assert_close(x.grad, sum(parts), **close)  # RS backward of AG, then AG backward of RS
    torch.testing.assert_close(M.gather_from_tensor_model_parallel_region(parts[r], g),
                               torch.cat(parts, dim=-1))

    # column -> GeLU -> row vs the unsharded reference, without and with SP
    for sp in (False, True):
        cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, sequence_parallel=sp,
                                params_dtype=torch.float32)
        w1, b1, w2, b2 = (t.requires_grad_(True) for t in (_rand(10, FFN, H), _rand(11, FFN), _rand(12, H, FFN),
                                                          _rand(13, H)))
        xf = _rand(14, S, B, H).requires_grad_(True)
        ref = F.linear(F.gelu(F.linear(xf, w1, b1)), w2, b2)
        ref.backward(_rand(15, S, B, H))
        col = ColumnParallelLinear(H, FFN, config=cfg, pstate=ps)
        row = RowParallelLinear(FFN, H, config=cfg, pstate=ps)
        assert col.weight.is_cuda
        with torch.no_grad():
            col.weight.copy_(w1.chunk(WORLD, 0)[r]); col.bias.copy_(b1.chunk(WORLD, 0)[r])
            row.weight.copy_(w2.chunk(WORLD, 1)[r]); row.bias.copy_(b2)
        xi = (xf.detach().chunk(WORLD, 0)[r] if sp else xf.detach()).clone().requires_grad_(True)
        with count_collectives() as c:
            out, _ = row(F.gelu(col(xi)[0]))
            out.backward(_rand(15, S, B, H).chunk(WORLD, 0)[r] if sp else _rand(15, S, B, H))
        # under SP the column layer gathers its kept input shard once more in the backward
        want = Counter(all_gather=3, reduce_scatter=2) if sp else Counter(all_reduce=2)
        assert c == want, c
        torch.testing.assert_close(out, ref.detach().chunk(WORLD, 0)[r] if sp else ref.detach(), **close)
        torch.testing.assert_close(xi.grad, xf.grad.chunk(WORLD, 0)[r] if sp else xf.grad, **close)
        torch.testing.assert_close(col.weight.grad, w1.grad.chunk(WORLD, 0)[r], **close)
        torch.testing.assert_close(row.weight.grad, w2.grad.chunk(WORLD, 1)[r], **close)

    # embedding + cross-entropy on CUDA
    emb = VocabParallelEmbedding(V, H, config=cfg, pstate=ps)
    table = _rand(20, V, H)
    with torch.no_grad():
        emb.weight.copy_(table.chunk(WORLD, 0)[r])
    ids = torch.randint(0, V, (B, S), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch.testing.assert_close(emb(ids), F.embedding(ids, table))
    logits = _rand(21, S, B, V)
    target = ids.t().contiguous()
    shard = logits.chunk(WORLD, -1)[r].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, g, label_smoothing=0.1)
    ref_logits = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.view(-1, V), target.view(-1), reduction="none", label_smoothing=0.1).view(S, B)
    torch.testing.assert_close(loss, ref, **close)
    loss.sum().backward(); ref.sum().backward()
    torch.testing.assert_close(shard.grad, ref_logits.grad.chunk(WORLD, -1)[r], **close)

    # CUDA RNG: per-rank inside fork, shared outside; recompute replays CUDA dropout
    model_parallel_seed(3, ps)
    with get_rng_tracker().fork():
        inside = torch.rand(4, device="cuda")
    outside = torch.rand(4, device="cuda")
    both = [torch.empty(2, 4, device="cuda") for _ in range(WORLD)]
    dist.all_gather(both, torch.stack([inside, outside]))
    assert not torch.equal(both[0][0], both[1][0]) and torch.equal(both[0][1], both[1][1])

    def fn(t):
        with get_rng_tracker().fork():
            return F.dropout(t * 2, 0.5, training=True)

    grads = []
    for recompute in (False, True):
        model_parallel_seed(4, ps)
        t = _rand(30, 64).requires_grad_(True)
        (checkpoint(fn, t) if recompute else fn(t)).sum().backward()
        grads.append(t.grad)
    assert torch.equal(grads[0], grads[1])

    batch = {"text": torch.arange(10).view(2, 5)} if r == 0 else None
    got = broadcast_data(["text"], batch, torch.int64, ps)
    assert got["text"].is_cuda and torch.equal(got["text"].cpu(), torch.arange(10).view(2, 5))


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA devices (NCCL)")
def test_nccl_path():
    run_distributed(_body, WORLD, backend="nccl", cuda=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_single_process():
    ps = ParallelState.single()
    # tracker on CUDA: the fork draws from its own stream and leaves the default CUDA stream alone
    model_parallel_seed(8, ps)
    a = torch.rand(5, device="cuda")
    with get_rng_tracker().fork():
        inside = torch.rand(5, device="cuda")
    b = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(8)  # replay without the fork (CUDA offsets advance per call, so draw 5 + 5)
    assert torch.equal(a, torch.rand(5, device="cuda")) and torch.equal(b, torch.rand(5, device="cuda"))
    torch.cuda.manual_seed(8 + 2718)
    assert torch.equal(inside, torch.rand(5, device="cuda"))

    # recomputation replays CUDA dropout in and out of the fork
    def fn(t):
        t = F.dropout(t, 0.5, training=True)
        with get_rng_tracker().fork():
            return F.dropout(t * 3, 0.5, training=True)

    grads = []
    for recompute in (False, True):
        model_parallel_seed(9, ps)
        t = torch.randn(256, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).requires_grad_(True)
        (checkpoint(fn, t) if recompute else fn(t)).square().sum().backward()
        grads.append(t.grad)
    assert torch.equal(grads[0], grads[1])

    # bf16 layers land on the GPU in params_dtype; the loss is fp32 and its grad bf16
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, params_dtype=torch.bfloat16)
    col = ColumnParallelLinear(H, V, config=cfg, pstate=ps)
    assert col.weight.is_cuda and col.weight.dtype == torch.bfloat16
    with torch.no_grad():
        col.weight.normal_(); col.bias.zero_()
    logits, _ = col(torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16))
    logits.retain_grad()
    target = torch.randint(0, V, (S, B), device="cuda")
    loss = vocab_parallel_cross_entropy(logits, target, None)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(logits.detach().float().view(-1, V), target.view(-1), reduction="none").view(S, B)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and col.weight.grad.dtype == torch.bfloat16
