"""Global L2 grad norm across TP, PP and DP without double counting, and clipping by it.

Which grads count on this rank (so every distinct element of the full model is counted exactly once):

* a parameter split across TP (``tensor_model_parallel=True``) counts on every TP rank (each holds a slice);
* a parameter replicated across TP (LayerNorm, row-parallel bias, ...) counts on TP rank 0 only; with
  ``sequence_parallel=True`` its grads were summed over TP by ``finalize_model_grads``, so the copies agree
  and counting once is right;
* the tied embedding (``shared_embedding=True``) exists on the first and last stage with identical grads
  after ``finalize_model_grads``; with ``pp > 1`` it counts on the first stage only;
* under the distributed optimizer each DP rank counts only the shard it owns.

The squared norms are summed over ``pstate.mp_group`` (TP x PP of one replica), and over the DP group too
when the grads are sharded.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch

from megatron.core.collectives import all_reduce, group_size


def param_counts_for_norm(param: torch.nn.Parameter, pstate) -> bool:
    """``True`` when this rank's copy of ``param`` contributes to the global grad norm."""
    if not getattr(param, "tensor_model_parallel", False) and pstate.tp_rank != 0:
        return False
    if getattr(param, "shared_embedding", False) and pstate.pp_size > 1 and not pstate.is_pipeline_first_stage:
        return False
    return True


def squared_norm(grads: List[torch.Tensor], device) -> torch.Tensor:
    """Sum of squares of ``grads`` as a [1] fp64 tensor on ``device``.

    On CUDA the per-tensor norms come from one fused fp32 multi-tensor kernel (tree reductions, accurate);
    on the CPU the fp32 norm kernel accumulates sequentially and loses ~1e-4 relative on tensors of a few
    million elements, which would make clipping depend on how tensors are split (e.g. into distributed-
    optimizer shards), so the CPU accumulates in fp64.
    """
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        if grads[0].device.type == "cuda":
            norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads], 2.0)
        else:
            norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]
        # one stack, then one cast: a cast per tensor was a kernel launch per parameter (148 at GPT-2 124M)
        total += torch.stack(norms).to(torch.float64).square().sum()
    return total


def global_grad_norm(grads_for_norm: List[torch.Tensor], groups: Iterable, device) -> float:
    """L2 norm of ``grads_for_norm`` summed (as squares) over every group in ``groups``."""
    total = squared_norm(grads_for_norm, device)
    for group in groups:
        if group is not None and group_size(group) > 1:
            all_reduce(total, group)
    value = float(total.item())
    return math.sqrt(value) if math.isfinite(value) else value


def global_grad_norm_tensor(grads_for_norm: List[torch.Tensor], groups: Iterable, device) -> torch.Tensor:
    """:func:`global_grad_norm` without the host synchronisation: the norm as a [1] fp64 tensor on ``device``."""
    total = squared_norm(grads_for_norm, device)
    for group in groups:
        if group is not None and group_size(group) > 1:
            all_reduce(total, group)
    return total.sqrt()


def clip_grads_by_total_norm(grads: List[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1 (as torch does)."""
    if max_norm <= 0 or not grads:
        return
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


def found_inf_in(grads: List[torch.Tensor], inv_scale: Optional[torch.Tensor], groups: Iterable, device) -> bool:
    """Unscale ``grads`` in place by ``inv_scale`` and report whether any rank of ``groups`` saw inf/nan."""
    found = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        if inv_scale is not None:
            inv = inv_scale.to(device)
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            except (RuntimeError, NotImplementedError):
                torch._foreach_mul_(grads, inv)
                found.fill_(float(not all(torch.isfinite(g).all().item() for g in grads)))
        else:
            found.fill_(float(not all(torch.isfinite(g).all().item() for g in grads)))
    for group in groups:
        if group is not None and group_size(group) > 1:
            all_reduce(found, group, op=torch.distributed.ReduceOp.MAX)
    return bool(found.item() > 0)
