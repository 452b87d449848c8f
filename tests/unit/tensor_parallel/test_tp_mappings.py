"""Parity of every conjugate operator (forward value, backward gradient, collective count) on gloo."""

from collections import Counter

import pytest
import torch

from megatron.core import collectives as C
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import mappings as M
from tests.dist_utils import run_distributed

S, B, H = 8, 2, 12  # divisible by 2 and 4 along the split dimensions


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run(op, x, upstream, group):
    """Forward ``op`` and backward ``upstream``; return (output, input grad, fwd counts, bwd counts)."""
    x = x.clone().requires_grad_(True)
    with C.count_collectives() as fwd:
        y = op(x, group)
    with C.count_collectives() as bwd:
        y.backward(upstream)
    return y.detach(), x.grad, fwd, bwd


def _check_ops(ps):
    g, r, tp = ps.tp_group, ps.tp_rank, ps.tp_size
    full = _rand(0, S, B, H)  # replicated tensor
    per_rank = [_rand(10 + q, S, B, H) for q in range(tp)]  # rank q's own tensor
    ws = [_rand(20 + q, S, B, H) for q in range(tp)]  # rank q's upstream gradient (full shape)
    ar, ag, rs = Counter(all_reduce=1), Counter(all_gather=1), Counter(reduce_scatter=1)
    none = Counter()

    def chunk(t, dim):
        return t.chunk(tp, dim=dim)[r]

    # f: identity forward, all-reduce backward.
    y, gx, fwd, bwd = _run(M.copy_to_tensor_model_parallel_region, full, ws[r], g)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, sum(ws))
    assert (fwd, bwd) == (none, ar)

    # g: all-reduce forward, identity backward.
    y, gx, fwd, bwd = _run(M.reduce_from_tensor_model_parallel_region, per_rank[r], ws[0], g)
    torch.testing.assert_close(y, sum(per_rank))
    torch.testing.assert_close(gx, ws[0])
    assert (fwd, bwd) == (ar, none)

    # scatter / gather along the last dimension.
    y, gx, fwd, bwd = _run(M.scatter_to_tensor_model_parallel_region, full, chunk(ws[r], -1), g)
    torch.testing.assert_close(y, chunk(full, -1))
    torch.testing.assert_close(gx, torch.cat([w.chunk(tp, -1)[q] for q, w in enumerate(ws)], dim=-1))
    assert (fwd, bwd) == (none, ag)

    y, gx, fwd, bwd = _run(M.gather_from_tensor_model_parallel_region, chunk(full, -1), ws[0], g)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, chunk(ws[0], -1))
    assert (fwd, bwd) == (ag, none)

    # sequence parallel: split / all-gather along dim 0.
    y, gx, fwd, bwd = _run(M.scatter_to_sequence_parallel_region, full, chunk(ws[r], 0), g)
    torch.testing.assert_close(y, chunk(full, 0))
    torch.testing.assert_close(gx, torch.cat([w.chunk(tp, 0)[q] for q, w in enumerate(ws)], dim=0))
    assert (fwd, bwd) == (none, ag)

    # all-gather / reduce-scatter (the consumer is tensor-parallel: partial grads per rank).
    y, gx, fwd, bwd = _run(M.gather_from_sequence_parallel_region, chunk(full, 0), ws[r], g)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, chunk(sum(ws), 0))
    assert (fwd, bwd) == (ag, rs)

    # all-gather / split (the consumer is replicated: the grad is already complete).
    op = lambda x, grp: M.gather_from_sequence_parallel_region(x, grp, tensor_parallel_output_grad=False)
    y, gx, fwd, bwd = _run(op, chunk(full, 0), ws[0], g)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, chunk(ws[0], 0))
    assert (fwd, bwd) == (ag, none)

    # reduce-scatter / all-gather.
    y, gx, fwd, bwd = _run(M.reduce_scatter_to_sequence_parallel_region, per_rank[r], chunk(ws[r], 0), g)
    torch.testing.assert_close(y, chunk(sum(per_rank), 0))
    torch.testing.assert_close(gx, torch.cat([w.chunk(tp, 0)[q] for q, w in enumerate(ws)], dim=0))
    assert (fwd, bwd) == (rs, ag)

    # No operator touches its input or a gradient shared with another branch (a residual add hands the same
    # gradient tensor to both of its inputs).
    a = full.clone().requires_grad_(True)
    b = full.clone().requires_grad_(True)
    keep = full.clone()
    out = M.copy_to_tensor_model_parallel_region(a, g) + b
    out2 = M.reduce_from_tensor_model_parallel_region(out, g)
    torch.testing.assert_close(out, keep * 2)  # the all-reduce did not write into its input
    out2.backward(ws[r])
    torch.testing.assert_close(b.grad, ws[r])
    torch.testing.assert_close(a.grad, sum(ws))

    # bf16 round trip of the dim-0 pair keeps dtype.
    xb = chunk(full, 0).to(torch.bfloat16)
    assert M.gather_from_sequence_parallel_region(xb, g).dtype == torch.bfloat16
    assert M.reduce_scatter_to_sequence_parallel_region(full.to(torch.bfloat16), g).dtype == torch.bfloat16

    # Indivisible sizes are refused with a clear message.
    bad = torch.zeros(tp + 1, 3)
    for fn in (M.scatter_to_sequence_parallel_region, M.reduce_scatter_to_sequence_parallel_region):
        with pytest.raises(ValueError, match="not divisible"):
            fn(bad, g)


def _body(rank, world):
    # TP=2 (two TP groups, the second made of global ranks 2 and 3) and TP=4, in one set of 4 processes
    for tp in (2, 4):
        _check_ops(ParallelState.build(tensor_model_parallel_size=tp))


def test_operators_parity_tp2_tp4():
    run_distributed(_body, 4)


def test_trivial_group_is_identity():
    x = torch.randn(4, 2, 6, requires_grad=True)
    with C.count_collectives() as c:
        for fn in (M.copy_to_tensor_model_parallel_region, M.reduce_from_tensor_model_parallel_region,
                   M.scatter_to_tensor_model_parallel_region, M.gather_from_tensor_model_parallel_region,
                   M.scatter_to_sequence_parallel_region, M.gather_from_sequence_parallel_region,
                   M.reduce_scatter_to_sequence_parallel_region):
            assert fn(x, None) is x
    assert c == Counter()


def test_counters_nest():
    with C.count_collectives() as outer:
        C._record("all_reduce")
        with C.count_collectives() as inner:
            C._record("all_gather")
    C._record("all_reduce")  # outside: not counted
    assert outer == Counter(all_reduce=1, all_gather=1) and inner == Counter(all_gather=1)
