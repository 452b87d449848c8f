"""Optimizer wrappers: the common step (unscale, inf check, norm, clip, update, copy back) and two layouts.

* :class:`FP32Optimizer` steps the model's fp32 params directly; ``param.grad`` is pointed at
  ``param.main_grad`` for the step.
* :class:`MixedPrecisionOptimizer` keeps an fp32 main copy of every bf16/fp16 param, steps the copies and
  casts them back into the model params.

The distributed optimizer (``distrib_optimizer.py``) is a third layout on the same base class.
``step()`` returns ``(update_successful, grad_norm, num_zeros)``; ``num_zeros`` is always ``None``.
"""

from __future__ import annotations

import abc
import math
from typing import List, Optional, Tuple

import torch

from megatron.core.grad_record import main_grad_of
from megatron.core.optimizer.clip_grads import (
    clip_grads_by_total_norm, found_inf_in, global_grad_norm, global_grad_norm_tensor, param_counts_for_norm,
)
from megatron.core.optimizer.fused_adamw import FusedAdamW
from megatron.core.optimizer.optimizer_config import OptimizerConfig


class MegatronOptimizer(abc.ABC):
    """Base class: owns the torch optimizer, the optional loss scaler and the shared ``step`` logic.

    Subclasses provide ``_copy_model_grads_to_main``, ``_main_grads``, ``_grads_for_norm``,
    ``_copy_main_params_to_model``, ``_release_grads``, ``_reduce_groups`` and the state-dict methods.
    """

    def __init__(self, config: OptimizerConfig, optimizer: torch.optim.Optimizer, model_chunks, pstate,
                 grad_scaler=None, device=None):
        self.config = config
        self.optimizer = optimizer
        self.model_chunks = list(model_chunks)
        self.pstate = pstate
        self.grad_scaler = grad_scaler
        self.device = device if device is not None else torch.device("cpu")
        self._one = torch.ones(1, dtype=torch.float32, device=self.device)
        # loading weights into a chunk (a model-only checkpoint, --finetune, --no-load-optim) must refresh the
        # fp32 main params; a later optimizer.load_state_dict() overrides them with the saved ones
        for chunk in self.model_chunks:
            inner = getattr(chunk, "module", chunk)
            inner.register_load_state_dict_post_hook(lambda module, incompatible: self.reload_model_params())

    # ---- interface used by the trainer ----------------------------------------------------------------
    @property
    def param_groups(self) -> List[dict]:
        """The torch optimizer's groups: the scheduler sets ``lr``/``weight_decay`` honouring ``lr_mult``/``wd_mult``."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        """Current loss scale as a [1] fp32 tensor (1.0 without fp16)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    def loss_scale_value(self) -> float:
        """The loss scale as a float for logging; 1.0 without fp16 read without touching the device (a read of
        the device tensor would wait for every queued step, e.g. one a CUDA graph runs ahead)."""
        return 1.0 if self.grad_scaler is None else float(self.grad_scaler.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: hand this to the schedule as ``grad_scale_func``."""
        return loss * self.get_loss_scale().to(loss.device, loss.dtype).reshape(())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the DDP grad buffers of every chunk and drop any ``.grad`` left on model or main params."""
        for chunk in self.model_chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
            else:
                for p in chunk.parameters():
                    main_grad = main_grad_of(p)
                    if main_grad is not None:
                        main_grad.zero_()
                    p.grad = None
        self._release_grads()

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """One update. Returns ``(update_successful, grad_norm, None)``.

        fp16 overflow (inf/nan after unscaling, on any rank of the reduction groups) skips the update and
        returns ``(False, None, None)``; a non-finite grad norm in any precision skips it and returns
        ``(False, norm, None)``, so the trainer can count skipped and nan iterations.
        """
        self._copy_model_grads_to_main()
        groups = self._reduce_groups()
        if self.grad_scaler is not None:
            found_inf = found_inf_in(self._main_grads(), self.grad_scaler.inv_scale, groups, self.device)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self._release_grads()
                return False, None, None
        grad_norm = global_grad_norm(self._grads_for_norm(), groups, self.device)
        if not math.isfinite(grad_norm):
            self._release_grads()
            return False, grad_norm, None
        if self._torch_fused() and self.config.clip_grad > 0:
            # clipping folded into the fused update: it divides every grad by grad_scale (saves a pass over them)
            coeff = self.config.clip_grad / (grad_norm + 1.0e-6)
            inv = torch.full((), 1.0 / coeff, dtype=torch.float32, device=self.device) if coeff < 1.0 else None
            self._torch_step(grad_scale=inv)
        else:
            clip_grads_by_total_norm(self._main_grads(), self.config.clip_grad, grad_norm)
            self.optimizer.step()
        self._release_grads()
        self._copy_main_params_to_model()
        return True, grad_norm, None

    def _torch_fused(self) -> bool:
        """True for torch's fused Adam/AdamW, whose step honours ``grad_scale`` and ``found_inf``."""
        return isinstance(self.optimizer, torch.optim.Optimizer) and bool(self.optimizer.defaults.get("fused"))

    def _torch_step(self, grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None):
        """The fused torch optimizer's step, dividing the grads by ``grad_scale`` and skipping when ``found_inf``."""
        self.optimizer.grad_scale, self.optimizer.found_inf = grad_scale, found_inf
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale, self.optimizer.found_inf

    @torch.no_grad()
    def step_without_sync(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The update of :meth:`step` with no host synchronisation, so it can be captured in a CUDA graph.

        Returns ``(found_inf, grad_norm)`` as device tensors: the torch optimizer skips the update by itself when
        the grad norm is not finite (``found_inf`` = 1). Needs bf16 or fp32 (no loss scaler) and a torch
        optimizer that honours ``found_inf`` (fused AdamW: ``OptimizerConfig(capturable=True)``).
        """
        if self.grad_scaler is not None:
            raise ValueError("a host-synchronisation-free step needs --bf16 or fp32 (no fp16 loss scaling)")
        if not self._torch_fused():
            raise ValueError("a host-synchronisation-free step needs the fused AdamW optimizer")
        self._copy_model_grads_to_main()
        grad_norm = global_grad_norm_tensor(self._grads_for_norm(), self._reduce_groups(), self.device)
        found_inf = (~torch.isfinite(grad_norm)).to(torch.float32).reshape(())  # 0-dim, as torch expects
        inv_coeff = None
        if self.config.clip_grad > 0:  # 1 / min(1, clip / (norm + 1e-6)), applied by the fused update
            inv_coeff = ((grad_norm + 1.0e-6) / self.config.clip_grad).clamp(min=1.0).to(torch.float32).reshape(())
        self._torch_step(grad_scale=inv_coeff, found_inf=found_inf)
        self._release_grads()
        self._copy_main_params_to_model()
        return found_inf, grad_norm

    def _load_torch_state(self, state: dict) -> None:
        """Load the torch optimizer's state dict, keeping this run's implementation choices.

        torch restores every param-group entry from the checkpoint, including ``fused``/``foreach``/``capturable``;
        a checkpoint written on the CPU (foreach) or without ``--enable-cuda-graph`` would then switch this run's
        optimizer implementation (and a captured step refuses a non-capturable group). Hyperparameters come from
        the checkpoint, the implementation from this run, and ``step`` counters move where it expects them.
        """
        self.optimizer.load_state_dict(state)
        defaults = self.optimizer.defaults
        for group in self.optimizer.param_groups:
            for key in ("fused", "foreach", "capturable"):
                if key in defaults:
                    group[key] = defaults[key]
            on_device = bool(group.get("fused")) or bool(group.get("capturable"))
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                if st and torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(device=p.device if on_device else "cpu", dtype=torch.float32)

    def reload_model_params(self) -> None:
        """Refresh the main params from the model params (after loading a model-only checkpoint)."""

    def owned_main_params(self) -> List[torch.Tensor]:
        """fp32 main params held in addition to the model params (for the memory report)."""
        return []

    # ---- hooks for subclasses ---------------------------------------------------------------------------
    def _reduce_groups(self) -> list:
        groups = []
        if self.pstate.mp_group is not None and (self.pstate.tp_size * self.pstate.pp_size) > 1:
            groups.append(self.pstate.mp_group)
        return groups

    @abc.abstractmethod
    def _copy_model_grads_to_main(self) -> None:
        ...

    @abc.abstractmethod
    def _main_grads(self) -> List[torch.Tensor]:
        ...

    @abc.abstractmethod
    def _grads_for_norm(self) -> List[torch.Tensor]:
        ...

    @abc.abstractmethod
    def _copy_main_params_to_model(self) -> None:
        ...

    @abc.abstractmethod
    def _release_grads(self) -> None:
        ...

    @abc.abstractmethod
    def state_dict(self) -> dict:
        ...

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict) -> None:
        ...


def _model_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The reduced grad of ``param``: its ``main_grad`` when wrapped by DDP, else ``param.grad``."""
    g = main_grad_of(param)
    return g if g is not None else param.grad


class FP32Optimizer(MegatronOptimizer):
    """fp32 model params stepped in place (the torch optimizer holds the model params themselves)."""

    def _params(self) -> List[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _copy_model_grads_to_main(self) -> None:
        for p in self._params():
            g = main_grad_of(p)
            if g is not None:
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)

    def _main_grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self._params() if p.grad is not None]

    def _grads_for_norm(self) -> List[torch.Tensor]:
        return [p.grad for p in self._params() if p.grad is not None and param_counts_for_norm(p, self.pstate)]

    def _copy_main_params_to_model(self) -> None:
        pass

    def _release_grads(self) -> None:
        for p in self._params():
            if main_grad_of(p) is not None:  # grads live in the DDP buffer; never leave an alias on .grad
                p.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        _check_not_distributed(state_dict)
        self._load_torch_state(state_dict["optimizer"])
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


def _check_not_distributed(state_dict: dict) -> None:
    if state_dict.get("distributed_optimizer"):
        raise ValueError("optimizer checkpoint was written by the distributed optimizer; load it with "
                         "--use-distributed-optimizer (or use --no-load-optim)")


class MixedPrecisionOptimizer(MegatronOptimizer):
    """bf16/fp16 model params with fp32 main params; the torch optimizer steps the main params.

    ``model_groups`` are the param groups built from the model (dicts with ``params`` and hyperparameters);
    the torch optimizer is built by ``make_optimizer(main_groups)`` over fp32 copies of the same layout.
    """

    def __init__(self, config: OptimizerConfig, make_optimizer, model_groups: List[dict], model_chunks, pstate,
                 grad_scaler=None, device=None):
        self.model_params: List[torch.nn.Parameter] = []
        self.main_params: List[torch.nn.Parameter] = []
        main_groups = []
        for group in model_groups:
            mains = []
            for p in group["params"]:
                main = torch.nn.Parameter(p.detach().clone().float())
                for attr in ("tensor_model_parallel", "sequence_parallel", "shared_embedding"):
                    if hasattr(p, attr):
                        setattr(main, attr, getattr(p, attr))
                self.model_params.append(p)
                self.main_params.append(main)
                mains.append(main)
            main_groups.append(dict(group, params=mains))
        super().__init__(config, make_optimizer(main_groups), model_chunks, pstate, grad_scaler, device)
        if isinstance(self.optimizer, FusedAdamW) and all(p.is_contiguous() for p in self.model_params):
            # its update writes the model params too: no separate copy pass
            self.optimizer.set_model_params(zip(self.main_params, self.model_params))

    def _copy_model_grads_to_main(self) -> None:
        for model, main in zip(self.model_params, self.main_params):
            g = _model_grad(model)
            main.grad = None if g is None else g.float()  # no copy when the buffer is already fp32

    def _main_grads(self) -> List[torch.Tensor]:
        return [m.grad for m in self.main_params if m.grad is not None]

    def _grads_for_norm(self) -> List[torch.Tensor]:
        return [main.grad for model, main in zip(self.model_params, self.main_params)
                if main.grad is not None and param_counts_for_norm(model, self.pstate)]

    def _copy_main_params_to_model(self) -> None:
        if self.model_params and not (isinstance(self.optimizer, FusedAdamW) and self.optimizer.writes_model_params):
            torch._foreach_copy_([p.data for p in self.model_params], [m.data for m in self.main_params])

    def _release_grads(self) -> None:
        for model, main in zip(self.model_params, self.main_params):
            main.grad = None
            if main_grad_of(model) is not None:
                model.grad = None

    def owned_main_params(self) -> List[torch.Tensor]:
        return list(self.main_params)

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for model, main in zip(self.model_params, self.main_params):
                main.data.copy_(model.data)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
                "fp32_from_fp16_params": [m.detach().clone() for m in self.main_params]}

    def load_state_dict(self, state_dict: dict) -> None:
        _check_not_distributed(state_dict)
        if "fp32_from_fp16_params" not in state_dict:
            raise ValueError("optimizer checkpoint holds no fp32 main params (saved without --bf16/--fp16?); "
                             "use --no-load-optim")
        self._load_torch_state(state_dict["optimizer"])
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved = state_dict["fp32_from_fp16_params"]
        if len(saved) != len(self.main_params):
            raise ValueError(
                f"optimizer checkpoint holds {len(saved)} main params but the model has {len(self.main_params)}"
            )
        with torch.no_grad():
            for main, value in zip(self.main_params, saved):
                main.data.copy_(value)
