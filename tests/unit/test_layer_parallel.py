"""A whole transformer layer / GPT under TP and SP against the unsharded model, and its collective counts."""

import torch

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.init import initialize_model_parameters
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import TransformerLayer
from tests.dist_utils import run_distributed


def _cfg(sp=False, **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64,
                attention_dropout=0.0, hidden_dropout=0.0, sequence_parallel=sp)
    base.update(kw)
    return TransformerConfig(**base)


def _layer_counts(rank, world):
    ps = ParallelState.build(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_seed(5, ps)
    for sp in (False, True):
        cfg = _cfg(sp)
        layer = TransformerLayer(cfg, ps)
        initialize_model_parameters(layer, 3, cfg, ps)
        s = cfg.seq_length // world if sp else cfg.seq_length
        x = torch.randn(s, 2, 32, requires_grad=True)
        with tensor_parallel.count_collectives() as fwd:
            y = layer(x)
        with tensor_parallel.count_collectives() as bwd:
            y.sum().backward()
        if not sp:  # Megatron: 2 all-reduces forward (g after attention and MLP), 2 backward (f before each)
            assert dict(fwd) == {"all_reduce": 2} and dict(bwd) == {"all_reduce": 2}, (fwd, bwd)
        else:  # each all-reduce becomes an all-gather (g-bar) and a reduce-scatter (g)
            assert dict(fwd) == {"all_gather": 2, "reduce_scatter": 2}, fwd
            # backward: the all-gathers' duals are reduce-scatters and the reduce-scatters' duals all-gathers, and
            # QKV and FC1 gather their kept input shards again for their weight gradients (Korthikanti et al.)
            assert dict(bwd) == {"all_gather": 4, "reduce_scatter": 2}, bwd


def test_layer_collective_counts():
    run_distributed(_layer_counts, 2)


def _gpt_parity(rank, world, sp):
    """Loss and every gradient of the sharded GPT equal the unsharded GPT's (same init, same data)."""
    ps = ParallelState.build(tensor_model_parallel_size=world)
    single = ParallelState.single()
    tensor_parallel.model_parallel_seed(5, ps)
    cfg_tp, cfg_1 = _cfg(sp), _cfg(False)
    model_tp, model_1 = GPTModel(cfg_tp, ps), GPTModel(cfg_1, single)
    initialize_model_parameters(model_tp, 9, cfg_tp, ps)
    initialize_model_parameters(model_1, 9, cfg_1, single)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    loss_tp = model_tp(ids, pos, labels=ids.roll(-1, 1))
    loss_1 = model_1(ids, pos, labels=ids.roll(-1, 1))
    torch.testing.assert_close(loss_tp, loss_1, rtol=1e-5, atol=1e-6)
    loss_tp.mean().backward()
    loss_1.mean().backward()
    full = dict(model_1.named_parameters())
    for name, p in model_tp.named_parameters():
        grad = p.grad
        if sp and getattr(p, "sequence_parallel", False):  # partial sums over the sequence shards
            grad = grad.clone()
            torch.distributed.all_reduce(grad, group=ps.tp_group)
        ref = full[name].grad
        if getattr(p, "tensor_model_parallel", False):
            ref = ref.chunk(world, dim=p.partition_dim)[ps.tp_rank]
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6, msg=name)


def test_gpt_tp2_matches_unsharded():
    run_distributed(_gpt_parity, 2, (False,))


def test_gpt_tp4_sequence_parallel_matches_unsharded():
    run_distributed(_gpt_parity, 4, (True,))
