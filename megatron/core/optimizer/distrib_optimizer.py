"""The distributed optimizer: fp32 main params and optimizer state sharded over the data-parallel ranks.

Each DP rank owns a contiguous range of every bucket of the DDP buffers (see
``megatron/core/distributed/grad_buffer.py``); a parameter crossing a range boundary is split by element
range into *pieces*. A rank keeps fp32 main params and optimizer moments for its pieces only, so optimizer
memory falls as 1/DP. One iteration:

    DDP reduce-scatter      grads of the owned range are the DP mean
    step                    unscale / inf check / norm (summed over MP and DP) / clip / update the pieces
    copy back               owned pieces -> the DDP param buffer (cast to the param dtype)
    all-gather              every replica's params become whole again (overlapped with the next forward
                            under ``overlap_param_gather``)

``state_dict()`` is collective over DP and independent of the DP size: full fp32 params and moments per
parameter, listed in parameter order; ``load_state_dict()`` slices out the pieces this rank owns, so a
checkpoint saved at DP=2 loads at DP=4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch

from megatron.core.collectives import all_gather_in_place, all_reduce
from megatron.core.optimizer.clip_grads import param_counts_for_norm
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig


@dataclass
class _Piece:
    """Elements ``[p_lo, p_hi)`` of the flattened ``param``, at ``[lo, hi)`` of ``buffer``, owned here."""

    param: torch.nn.Parameter
    chunk: int
    buffer: object  # GradBuffer
    bucket: int
    lo: int
    hi: int
    p_lo: int
    p_hi: int
    main: torch.nn.Parameter  # [hi - lo] fp32
    aliased: bool  # main is a view of the fp32 param buffer (no extra copy)


class DistributedOptimizer(MegatronOptimizer):
    """Shards fp32 main params and optimizer state over DP; see the module docstring."""

    def __init__(self, config: OptimizerConfig, make_optimizer, model_groups: List[dict], model_chunks, pstate,
                 grad_scaler=None, device=None):
        model_chunks = list(model_chunks)
        self.dp_group = model_chunks[0].dp_group if model_chunks else None
        self.dp_size = model_chunks[0].dp_size if model_chunks else 1
        self.dp_rank = model_chunks[0].dp_rank if model_chunks else 0
        group_of = {id(p): gi for gi, g in enumerate(model_groups) for p in g["params"]}
        self.param_order: List[torch.nn.Parameter] = []  # every trainable param, chunk by chunk, in module order
        seen = set()
        for chunk in model_chunks:
            for p in chunk.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.param_order.append(p)
        self.pieces: List[_Piece] = []
        main_groups = [dict(g, params=[]) for g in model_groups]
        for ci, chunk in enumerate(model_chunks):
            for buf in chunk.buffers:
                for p, lo, hi, p_lo, p_hi in buf.local_pieces(self.dp_rank):
                    aliased = buf.param_data.dtype == torch.float32
                    data = buf.param_data[lo:hi] if aliased else buf.param_data[lo:hi].detach().clone().float()
                    main = torch.nn.Parameter(data)  # shares storage with the param buffer when aliased
                    piece = _Piece(p, ci, buf, buf.param_to_bucket[p].index, lo, hi, p_lo, p_hi, main, aliased)
                    self.pieces.append(piece)
                    main_groups[group_of[id(p)]]["params"].append(main)
        self._piece_of_main = {id(pc.main): pc for pc in self.pieces}
        super().__init__(config, make_optimizer(main_groups), model_chunks, pstate, grad_scaler, device)

    # ---- step hooks ---------------------------------------------------------------------------------------
    def _reduce_groups(self) -> list:
        groups = super()._reduce_groups()
        if self.dp_size > 1:
            groups.append(self.dp_group)
        return groups

    def _copy_model_grads_to_main(self) -> None:
        for chunk in self.model_chunks:  # an overlapped all-gather of the last step must not race this update
            chunk.finish_param_sync()
        for pc in self.pieces:
            pc.main.grad = pc.buffer.grad_data[pc.lo:pc.hi].float()  # [hi - lo]; a view when fp32

    def _main_grads(self) -> List[torch.Tensor]:
        return [pc.main.grad for pc in self.pieces if pc.main.grad is not None]

    def _grads_for_norm(self) -> List[torch.Tensor]:
        return [pc.main.grad for pc in self.pieces
                if pc.main.grad is not None and param_counts_for_norm(pc.param, self.pstate)]

    def _release_grads(self) -> None:
        for pc in self.pieces:
            pc.main.grad = None

    def _copy_main_params_to_model(self) -> None:
        with torch.no_grad():
            for pc in self.pieces:
                if not pc.aliased:
                    pc.buffer.param_data[pc.lo:pc.hi].copy_(pc.main)
        for chunk in self.model_chunks:
            chunk.start_param_sync(overlap=self.config.overlap_param_gather)

    def owned_main_params(self) -> List[torch.Tensor]:
        return [pc.main for pc in self.pieces if not pc.aliased]

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for pc in self.pieces:
                if not pc.aliased:
                    pc.main.data.copy_(pc.buffer.param_data[pc.lo:pc.hi])

    # ---- DP-size independent checkpoints -------------------------------------------------------------
    def _tensor_state_keys(self) -> List[str]:
        if self.config.optimizer == "adam":
            return ["exp_avg", "exp_avg_sq"]
        return ["momentum_buffer"] if self.config.sgd_momentum else []

    def _scalar_state_keys(self) -> List[str]:
        return ["step"] if isinstance(self.optimizer, torch.optim.AdamW) else []

    def _dp_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64 if self.device.type == "cpu" else torch.float32,
                         device=self.device)
        if self.dp_size > 1:
            all_reduce(t, self.dp_group, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())

    def state_dict(self) -> dict:
        """Full (unsharded) fp32 params and moments per parameter; collective over the DP group."""
        initialized = self._dp_max(float(any(self.optimizer.state.get(pc.main) for pc in self.pieces))) > 0
        tensor_keys = self._tensor_state_keys() if initialized else []
        scalars = {}
        for key in self._scalar_state_keys() if initialized else []:
            local = [float(s[key]) for pc in self.pieces for s in [self.optimizer.state.get(pc.main, {})] if key in s]
            scalars[key] = self._dp_max(local[0] if local else float("-inf"))

        full: Dict[int, Dict[str, torch.Tensor]] = {id(p): {} for p in self.param_order}
        by_bucket: Dict[tuple, List[_Piece]] = {}
        for pc in self.pieces:
            by_bucket.setdefault((id(pc.buffer), pc.bucket), []).append(pc)
        for chunk in self.model_chunks:
            for buf in chunk.buffers:
                for bucket in buf.buckets:
                    mine = by_bucket.get((id(buf), bucket.index), [])
                    for name in ["param"] + tensor_keys:
                        flat = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)  # [bucket]
                        for pc in mine:
                            value = pc.main if name == "param" else self.optimizer.state[pc.main][name]
                            flat[pc.lo - bucket.start:pc.hi - bucket.start].copy_(value.detach().reshape(-1))
                        if self.dp_size > 1:
                            all_gather_in_place(flat, self.dp_group)
                        for p in bucket.params:
                            s, e = buf.index[p]
                            full[id(p)][name] = flat[s - bucket.start:e - bucket.start].view(p.shape).cpu().clone()
        return {
            "distributed_optimizer": True,
            "state_initialized": initialized,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "params": [full[id(p)] for p in self.param_order],
            "scalar_state": scalars,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` saved at any DP size: keep the pieces this rank owns."""
        if not state_dict.get("distributed_optimizer"):
            raise ValueError("optimizer checkpoint was not written by the distributed optimizer; "
                             "load it without --use-distributed-optimizer (or use --no-load-optim)")
        saved = state_dict["params"]
        if len(saved) != len(self.param_order):
            raise ValueError(f"optimizer checkpoint holds {len(saved)} params but the model has {len(self.param_order)}")
        for i, (p, entry) in enumerate(zip(self.param_order, saved)):
            if tuple(entry["param"].shape) != tuple(p.shape):
                raise ValueError(f"optimizer checkpoint param {i} has shape {tuple(entry['param'].shape)}, "
                                 f"the model's is {tuple(p.shape)}")
        index = {id(p): i for i, p in enumerate(self.param_order)}
        with torch.no_grad():
            for pc in self.pieces:
                pc.main.copy_(saved[index[id(pc.param)]]["param"].reshape(-1)[pc.p_lo:pc.p_hi])

        if len(state_dict["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"optimizer checkpoint has {len(state_dict['param_groups'])} param groups, "
                             f"this optimizer {len(self.optimizer.param_groups)}")
        torch_state, torch_groups, pid = {}, [], 0
        for group, saved_group in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            ids = []
            for main in group["params"]:
                pc = self._piece_of_main[id(main)]
                if state_dict["state_initialized"]:
                    entry = saved[index[id(pc.param)]]
                    st = {k: entry[k].reshape(-1)[pc.p_lo:pc.p_hi].clone() for k in self._tensor_state_keys()}
                    for k, v in state_dict["scalar_state"].items():
                        st[k] = torch.tensor(v, dtype=torch.float32)
                    torch_state[pid] = st
                ids.append(pid)
                pid += 1
            torch_groups.append(dict(saved_group, params=ids))
        self._load_torch_state({"state": torch_state, "param_groups": torch_groups})
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        # the model params must hold the loaded main params (the owned pieces, then all-gathered)
        self._copy_main_params_to_model()
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
