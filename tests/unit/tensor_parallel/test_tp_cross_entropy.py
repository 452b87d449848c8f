"""vocab_parallel_cross_entropy against F.cross_entropy (with label smoothing) on the unsharded logits."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import count_collectives, vocab_parallel_cross_entropy
from tests.dist_utils import run_distributed

S, B, V = 6, 3, 32
TOL = dict(rtol=1e-6, atol=1e-6)


def _reference(logits, target, eps):
    """Per-token loss [s, b] and d(sum(loss * up))/d logits from torch, in float64."""
    x = logits.detach().double().requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, V), target.reshape(-1), reduction="none", label_smoothing=eps)
    return loss.view(S, B), x


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(S, B, V, generator=gen)  # [s, b, V]
    target = torch.randint(0, V, (S, B), generator=gen)
    target[0] = torch.tensor([0, V - 1, V // 2])[:B]  # ids at the shard edges
    up = torch.rand(S, B, generator=gen)
    return logits, target, up


def _check(ps):
    tp = ps.tp_size
    for eps in (0.0, 0.1):
        logits, target, up = _data(3)
        ref_loss, ref_x = _reference(logits, target, eps)
        (ref_loss * up.double()).sum().backward()

        shard = logits.chunk(tp, -1)[ps.tp_rank].clone().requires_grad_(True)  # [s, b, V/tp]
        before = shard.detach().clone()
        with count_collectives() as fwd:
            loss = vocab_parallel_cross_entropy(shard, target, ps.tp_group, label_smoothing=eps)
        with count_collectives() as bwd:
            loss.backward(up)
        assert loss.dtype == torch.float32 and loss.shape == (S, B)
        assert fwd == Counter(all_reduce=2) and bwd == Counter()  # max, then [target logit, sum-exp(, sum)]
        torch.testing.assert_close(loss.double(), ref_loss.detach(), **TOL)
        torch.testing.assert_close(shard.grad.double(), ref_x.grad.chunk(tp, -1)[ps.tp_rank], **TOL)
        torch.testing.assert_close(shard.detach(), before)  # the input logits are not modified


def _body(rank, world):
    for tp in (2, 4):  # TP=2 (x DP=2) and TP=4 in one set of 4 processes
        _check(ParallelState.build(tensor_model_parallel_size=tp))


def test_vocab_parallel_cross_entropy_parity_tp2_tp4():
    run_distributed(_body, 4)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_single_process_matches_torch(eps):
    logits, target, up = _data(5)
    ref_loss, ref_x = _reference(logits, target, eps)
    (ref_loss * up.double()).sum().backward()
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, None, label_smoothing=eps)
    loss.backward(up)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **TOL)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, **TOL)


def test_bf16_logits_give_fp32_loss_and_bf16_grad():
    logits, target, _ = _data(7)
    x = logits.to(torch.bfloat16).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, None)
    ref_loss, _ = _reference(x.detach().float(), target, 0.0)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_bad_input_is_refused():
    logits, target, _ = _data(8)
    with pytest.raises(ValueError, match="label-smoothing"):
        vocab_parallel_cross_entropy(logits, target, None, label_smoothing=1.0)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(logits, target[:-1], None)
    loss = vocab_parallel_cross_entropy(logits.clone().requires_grad_(True), target, None)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.sum().backward()
