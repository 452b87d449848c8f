"""Column/Row-parallel linear and vocab-parallel embedding against the unsharded torch.nn modules (gloo)."""

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    LinearConfig,
    TPSharding,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    count_collectives,
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.tensor_parallel.mappings import all_reduce_sum
from tests.dist_utils import run_distributed

S, B, H, FFN, V = 8, 2, 16, 32, 24
TOL = dict(rtol=1e-10, atol=1e-10)


def _cfg(sp, dtype=torch.float64):
    return LinearConfig(sequence_parallel=sp, params_dtype=dtype)


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ref_linear(seed, n_in, n_out):
    ref = nn.Linear(n_in, n_out, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(_rand(seed, n_out, n_in))
        ref.bias.copy_(_rand(seed + 1, n_out))
    return ref


def _check_column(ps, sp, tp):
    r, g = ps.tp_rank, ps.tp_group
    ref = _ref_linear(1, H, FFN)
    x_full = _rand(2, S, B, H).requires_grad_(True)
    up = _rand(3, S, B, FFN)  # d loss / d Y
    y_ref = ref(x_full)
    y_ref.backward(up)

    for gather_output in ([False] if sp else [False, True]):
        col = ColumnParallelLinear(H, FFN, config=_cfg(sp), pstate=ps, gather_output=gather_output)
        assert col.weight.shape == (FFN // tp, H) and col.weight.partition_dim == 0
        assert col.weight.tensor_model_parallel and col.bias.tensor_model_parallel and col.bias.partition_dim == 0
        with torch.no_grad():
            col.weight.copy_(ref.weight.chunk(tp, 0)[r])
            col.bias.copy_(ref.bias.chunk(tp, 0)[r])
        x = (x_full.detach().chunk(tp, 0)[r] if sp else x_full.detach()).clone().requires_grad_(True)
        saved = []
        w_ptr = col.weight.untyped_storage().data_ptr()

        def pack(t):  # record the size of every saved activation (not the weight)
            if t.untyped_storage().data_ptr() != w_ptr:
                saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, bias = col(x)
        assert bias is None
        # the activation kept for backward: the full [s, b, in], or under SP only the local shard
        kept = S // tp * B * H if sp else S * B * H
        assert saved == [kept], saved
        if gather_output:
            torch.testing.assert_close(y, y_ref, **TOL)
            y.backward(up)
        else:
            torch.testing.assert_close(y, y_ref.chunk(tp, -1)[r], **TOL)
            y.backward(up.chunk(tp, -1)[r])
        torch.testing.assert_close(col.weight.grad, ref.weight.grad.chunk(tp, 0)[r], **TOL)
        torch.testing.assert_close(col.bias.grad, ref.bias.grad.chunk(tp, 0)[r], **TOL)
        want_gx = x_full.grad.chunk(tp, 0)[r] if sp else x_full.grad
        torch.testing.assert_close(x.grad, want_gx, **TOL)

    # skip_bias_add hands the bias back; an external weight (tied output layer) is accepted.
    col = ColumnParallelLinear(H, FFN, config=_cfg(sp), pstate=ps, skip_bias_add=True,
                               skip_weight_param_allocation=True)
    assert col.weight is None
    with torch.no_grad():
        col.bias.copy_(ref.bias.chunk(tp, 0)[r])
    x = x_full.detach().chunk(tp, 0)[r] if sp else x_full.detach()
    y, bias = col(x, weight=ref.weight.detach().chunk(tp, 0)[r])
    assert bias is col.bias
    torch.testing.assert_close(y + bias, y_ref.detach().chunk(tp, -1)[r], **TOL)


def _check_row(ps, sp, tp):
    r, g = ps.tp_rank, ps.tp_group
    ref = _ref_linear(4, FFN, H)
    x_full = _rand(5, S, B, FFN).requires_grad_(True)
    up = _rand(6, S, B, H)
    y_ref = ref(x_full)
    y_ref.backward(up)

    for input_is_parallel in ([True] if sp else [True, False]):
        row = RowParallelLinear(FFN, H, config=_cfg(sp), pstate=ps, input_is_parallel=input_is_parallel)
        assert row.weight.shape == (H, FFN // tp) and row.weight.partition_dim == 1
        assert not row.bias.tensor_model_parallel and row.bias.sequence_parallel == sp
        with torch.no_grad():
            row.weight.copy_(ref.weight.chunk(tp, 1)[r])
            row.bias.copy_(ref.bias)
        x_in = x_full.detach().chunk(tp, -1)[r] if input_is_parallel else x_full.detach()
        x = x_in.clone().requires_grad_(True)
        y, bias = row(x)
        assert bias is None
        if sp:
            torch.testing.assert_close(y, y_ref.chunk(tp, 0)[r], **TOL)
            y.backward(up.chunk(tp, 0)[r])
            # each rank's bias grad covers its own tokens; finalize_model_grads sums them over TP
            torch.testing.assert_close(all_reduce_sum(row.bias.grad, g), ref.bias.grad, **TOL)
        else:
            torch.testing.assert_close(y, y_ref, **TOL)
            y.backward(up)
            torch.testing.assert_close(row.bias.grad, ref.bias.grad, **TOL)
        torch.testing.assert_close(row.weight.grad, ref.weight.grad.chunk(tp, 1)[r], **TOL)
        want_gx = x_full.grad.chunk(tp, -1)[r] if input_is_parallel else x_full.grad
        torch.testing.assert_close(x.grad, want_gx, **TOL)

    row = RowParallelLinear(FFN, H, config=_cfg(sp), pstate=ps, skip_bias_add=True)
    _, bias = row(torch.zeros(S, B, FFN // tp, dtype=torch.float64))  # [s, b, ffn/tp] in either mode
    assert bias is row.bias


def _check_mlp_pair(ps, sp, tp):
    """Column -> GeLU -> Row equals the unsharded MLP, with Megatron's collective count."""
    r = ps.tp_rank
    fc1, fc2 = _ref_linear(7, H, FFN), _ref_linear(8, FFN, H)
    x_full = _rand(9, S, B, H).requires_grad_(True)
    up = _rand(10, S, B, H)
    y_ref = fc2(F.gelu(fc1(x_full)))
    y_ref.backward(up)

    col = ColumnParallelLinear(H, FFN, config=_cfg(sp), pstate=ps, skip_bias_add=True)
    row = RowParallelLinear(FFN, H, config=_cfg(sp), pstate=ps)
    with torch.no_grad():
        col.weight.copy_(fc1.weight.chunk(tp, 0)[r]); col.bias.copy_(fc1.bias.chunk(tp, 0)[r])
        row.weight.copy_(fc2.weight.chunk(tp, 1)[r]); row.bias.copy_(fc2.bias)
    x = (x_full.detach().chunk(tp, 0)[r] if sp else x_full.detach()).clone().requires_grad_(True)
    with count_collectives() as fwd:
        inter, inter_bias = col(x)
        y, _ = row(F.gelu(inter + inter_bias))
    with count_collectives() as bwd:
        y.backward(up.chunk(tp, 0)[r] if sp else up)
    if sp:  # each all-reduce becomes reduce-scatter + all-gather
        assert fwd == Counter(all_gather=1, reduce_scatter=1), fwd
        # the column layer keeps only its input shard and gathers it once more in the backward
        assert bwd == Counter(all_gather=2, reduce_scatter=1), bwd
        torch.testing.assert_close(y, y_ref.detach().chunk(tp, 0)[r], **TOL)
        torch.testing.assert_close(x.grad, x_full.grad.chunk(tp, 0)[r], **TOL)
    else:  # g in the forward, f in the backward
        assert fwd == Counter(all_reduce=1), fwd
        assert bwd == Counter(all_reduce=1), bwd
        torch.testing.assert_close(y, y_ref.detach(), **TOL)
        torch.testing.assert_close(x.grad, x_full.grad, **TOL)
    torch.testing.assert_close(col.weight.grad, fc1.weight.grad.chunk(tp, 0)[r], **TOL)
    torch.testing.assert_close(row.weight.grad, fc2.weight.grad.chunk(tp, 1)[r], **TOL)


def _check_embedding(ps, tp):
    r = ps.tp_rank
    ref = nn.Embedding(V, H, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(_rand(11, V, H))
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(12))
    ids[0, :3] = torch.tensor([0, V // tp, V - 1])  # shard boundaries
    up = _rand(13, B, S, H)
    y_ref = ref(ids)
    y_ref.backward(up)

    emb = VocabParallelEmbedding(V, H, config=_cfg(False), pstate=ps)
    assert emb.weight.shape == (V // tp, H) and emb.weight.partition_dim == 0
    with torch.no_grad():
        emb.weight.copy_(ref.weight.chunk(tp, 0)[r])
    with count_collectives() as fwd:
        y = emb(ids)
    with count_collectives() as bwd:
        y.backward(up)
    assert fwd == Counter(all_reduce=1) and bwd == Counter()
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad.chunk(tp, 0)[r], **TOL)


def _check_all(ps):
    tp = ps.tp_size
    for sp in (False, True):
        _check_column(ps, sp, tp)
        _check_row(ps, sp, tp)
        _check_mlp_pair(ps, sp, tp)
    _check_embedding(ps, tp)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        ColumnParallelLinear(H, tp + 1, config=_cfg(False), pstate=ps)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        VocabParallelEmbedding(tp * 3 + 1, H, config=_cfg(False), pstate=ps)


def _body(rank, world):
    for tp in (2, 4):  # TP=2 (x DP=2) and TP=4 in one set of 4 processes
        _check_all(ParallelState.build(tensor_model_parallel_size=tp))


def test_layers_parity_tp2_tp4():
    run_distributed(_body, 4)


def test_single_process_layers_match_torch():
    """TP=1 (no process group): the layers are plain nn.Linear / nn.Embedding, in config.params_dtype."""
    ps = ParallelState.single()
    cfg = _cfg(False, dtype=torch.bfloat16)
    col = ColumnParallelLinear(H, FFN, config=cfg, pstate=ps)
    row = RowParallelLinear(FFN, H, config=cfg, pstate=ps, bias=False)
    emb = VocabParallelEmbedding(V, H, config=cfg, pstate=ps)
    for p in (col.weight, col.bias, row.weight, emb.weight):
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
    assert row.bias is None and row(torch.zeros(S, B, FFN, dtype=torch.bfloat16))[1] is None
    with pytest.raises(IndexError):
        emb(torch.tensor([[V]]))  # out-of-range ids are an error, as in nn.Embedding
    with pytest.raises(ValueError, match="sequence-parallel"):
        RowParallelLinear(FFN, H, config=_cfg(True), pstate=ps, input_is_parallel=False)
    with pytest.raises(ValueError, match="sequence-parallel"):
        ColumnParallelLinear(H, FFN, config=_cfg(True), pstate=ps, gather_output=True)


def test_attribute_helpers():
    ps = ParallelState.single()
    col = ColumnParallelLinear(H, FFN, config=_cfg(False), pstate=ps)
    master = torch.empty_like(col.weight, dtype=torch.float32)
    copy_tensor_model_parallel_attributes(master, col.weight)
    assert (master.tensor_model_parallel, master.partition_dim, master.tp_sharding) == (True, 0, TPSharding(0))
    plain = torch.empty(3)
    copy_tensor_model_parallel_attributes(plain, torch.empty(3))
    assert (plain.tensor_model_parallel, plain.partition_dim, plain.tp_sharding) == (False, -1, None)
    assert param_is_not_tensor_parallel_duplicate(col.weight, ps)
