"""Global grad norm and clipping under TP x PP, TP x DP and PP x DP (the last two with the distributed
optimizer), checked against
``torch.nn.utils.clip_grad_norm_`` on the full unsharded grads; finalize_model_grads' TP and embedding sums.

Every rank holds, per pipeline stage s:
  A_s  split across TP (rows)               tensor_model_parallel=True
  B_s  replicated across TP                 (LayerNorm-like)
  C_s  replicated, sequence_parallel=True   each TP rank holds a partial grad; the true grad is their sum
  E    the tied embedding, split across TP, on the first and last stage (shared_embedding=True with pp > 1);
       each stage holds a partial grad; the true grad is their sum
"""

import torch

from megatron.core.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megatron.core.grad_record import add_grad
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed

MAX_NORM = 0.3


def _full(name, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _full_grads(pp, TP):
    """name -> full true grad; and the partial grads that sum to C_s and E."""
    grads, partial = {}, {}
    for s in range(pp):
        grads[f"A{s}"] = _full("A", (8, 6), 10 + s)
        grads[f"B{s}"] = _full("B", (6,), 20 + s)
        parts = [_full("C", (6,), 30 + 10 * s + t) for t in range(TP)]
        partial[f"C{s}"] = parts
        grads[f"C{s}"] = sum(parts)
    parts = [_full("E", (10, 6), 50 + s) for s in range(pp)]
    partial["E"] = parts
    grads["E"] = sum(parts)
    return grads, partial


class _Stage(torch.nn.Module):
    def __init__(self, stage, tp_rank, tp, pp):
        super().__init__()
        rows = slice(tp_rank * 8 // tp, (tp_rank + 1) * 8 // tp)
        self.A = torch.nn.Parameter(_full("A", (8, 6), 110 + stage)[rows].clone())
        self.A.tensor_model_parallel, self.A.partition_dim = True, 0
        self.B = torch.nn.Parameter(_full("B", (6,), 120 + stage))
        self.C = torch.nn.Parameter(_full("C", (6,), 130 + stage))
        self.C.sequence_parallel = True
        self.E = torch.nn.Parameter(_full("E", (10, 6), 140)[tp_rank * 10 // tp:(tp_rank + 1) * 10 // tp].clone())
        self.E.tensor_model_parallel, self.E.partition_dim = True, 0
        self.E.shared_embedding = pp > 1


def _body(rank, world, TP, pp, distopt):
    pstate = ParallelState.build(TP, pp)
    s, t = pstate.pp_rank, pstate.tp_rank
    module = _Stage(s, t, TP, pp)
    ddp = DistributedDataParallel(module, pstate=pstate, config=DDPConfig(use_distributed_optimizer=distopt))
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=1.0, weight_decay=0.0, clip_grad=MAX_NORM,
                        use_distributed_optimizer=distopt), [ddp], pstate)
    grads, partial = _full_grads(pp, TP)
    rows, erows = slice(t * 8 // TP, (t + 1) * 8 // TP), slice(t * 10 // TP, (t + 1) * 10 // TP)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    opt.zero_grad()  # marks the main grads zero: the first gradient stored is written
    add_grad(module.A, grads[f"A{s}"][rows])
    add_grad(module.B, grads[f"B{s}"])
    add_grad(module.C, partial[f"C{s}"][t])
    add_grad(module.E, partial["E"][s][erows] if pp > 1 else grads["E"][erows])
    finalize_model_grads([ddp], pstate)
    # finalize summed C over TP and E over the embedding group (under the distributed optimizer only the
    # owned shard of C is valid; E's whole grad is made valid before the embedding all-reduce)
    if not distopt:
        torch.testing.assert_close(module.C.main_grad, grads[f"C{s}"])
    if not distopt or pp > 1:
        torch.testing.assert_close(module.E.main_grad, grads["E"][erows])

    # reference: every distinct parameter once, full size
    ref = {n: torch.zeros_like(g, requires_grad=True) for n, g in grads.items()}
    for n, r in ref.items():
        r.grad = grads[n].clone()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref.values()), MAX_NORM))
    ok, norm, _ = opt.step()
    assert ok and ref_norm > MAX_NORM
    assert abs(norm - ref_norm) < 1e-6 * ref_norm, (norm, ref_norm)
    # SGD with lr 1: each param moved by minus its clipped grad
    expect = {"A": ref["A%d" % s].grad[rows], "B": ref["B%d" % s].grad, "C": ref["C%d" % s].grad,
              "E": ref["E"].grad[erows]}
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), start[n] - expect[n], rtol=0, atol=1e-6)


LAYOUTS = [(2, 2, False), (2, 1, True), (1, 2, True)]  # (tp, pp, distributed optimizer): TPxPP, TPxDP, PPxDP


def _all_layouts(rank, world):
    for tp, pp, distopt in LAYOUTS:  # one set of processes for every layout (spawning is the slow part)
        _body(rank, world, tp, pp, distopt)


def test_global_norm_counts_each_param_once():
    run_distributed(_all_layouts, 4)
