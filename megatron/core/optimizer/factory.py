"""Build the optimizer the trainer uses: param groups, the torch optimizer, the wrapper for the precision."""

from __future__ import annotations

from typing import List

import torch

from megatron.core.optimizer.fused_adamw import FusedAdamW, fused_adamw_available
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer, MixedPrecisionOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig


def build_param_groups(model_chunks, config: OptimizerConfig) -> List[dict]:
    """Two groups, always in this order: weight-decayed params (>= 2-D) and no-decay params (1-D: biases, norms).

    Each group carries ``lr_mult``/``wd_mult`` (the scheduler writes ``lr = lr * lr_mult`` and
    ``weight_decay = wd * wd_mult``). Both groups exist even when empty so the layout is the same on every rank.
    """
    decay, no_decay, seen = [], [], set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if p.dim() <= 1 else decay).append(p)
    return [
        {"params": decay, "lr": config.lr, "weight_decay": config.weight_decay, "lr_mult": 1.0, "wd_mult": 1.0},
        {"params": no_decay, "lr": config.lr, "weight_decay": 0.0, "lr_mult": 1.0, "wd_mult": 0.0},
    ]


def _apex_fused_adam():
    try:
        from apex.optimizers import FusedAdam  # optional, CUDA only
        return FusedAdam
    except Exception:  # apex absent or built without its CUDA extensions
        return None


def make_torch_optimizer(config: OptimizerConfig, groups: List[dict], device: torch.device,
                         for_model_copies: bool = False) -> torch.optim.Optimizer:
    """AdamW or SGD over ``groups``.

    AdamW for fp32 main params with 16-bit model copies (``for_model_copies``) on CUDA is our Triton
    :class:`FusedAdamW`, which writes the copies in its update, unless ``config.fused_adamw`` is off or Triton is
    missing. Otherwise: apex's FusedAdam when importable, else torch's fused AdamW; on the CPU torch's foreach
    AdamW. ``config.capturable`` needs a step that honours ``found_inf`` and reads a device learning rate (CUDA-graph
    capture): FusedAdamW, or torch's fused AdamW with ``capturable=True``.
    """
    on_cuda = device.type == "cuda"
    if config.optimizer == "adam":
        betas = (config.adam_beta1, config.adam_beta2)
        if for_model_copies and config.fused_adamw and fused_adamw_available(device):
            return FusedAdamW(groups, lr=config.lr, betas=betas, eps=config.adam_eps,
                              weight_decay=config.weight_decay, capturable=config.capturable)
        if config.capturable:
            return torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.adam_eps,
                                     weight_decay=config.weight_decay, fused=True, capturable=True)
        fused_adam = _apex_fused_adam() if on_cuda else None
        if fused_adam is not None:
            return fused_adam(groups, lr=config.lr, betas=betas, eps=config.adam_eps,
                              weight_decay=config.weight_decay, adam_w_mode=True)
        kwargs = {"fused": True} if on_cuda else {"foreach": True}
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.adam_eps,
                                 weight_decay=config.weight_decay, **kwargs)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay,
                           foreach=not on_cuda or None)


def make_grad_scaler(config: OptimizerConfig, device):
    """The fp16 loss scaler (static with ``loss_scale``, else dynamic); ``None`` for fp32 and bf16."""
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device=device)
    return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale, growth_interval=config.loss_scale_window,
                             hysteresis=config.hysteresis, device=device)


def _check_chunks(config: OptimizerConfig, model_chunks, pstate) -> None:
    wrapped = [getattr(getattr(c, "config", None), "use_distributed_optimizer", None) for c in model_chunks]
    if config.use_distributed_optimizer and not all(wrapped):
        raise ValueError(
            "--use-distributed-optimizer needs every model chunk wrapped in DistributedDataParallel with "
            "DDPConfig(use_distributed_optimizer=True)"
        )
    if not config.use_distributed_optimizer and any(wrapped):
        raise ValueError("the model was wrapped for the distributed optimizer but --use-distributed-optimizer is off")
    dtypes = {p.dtype for c in model_chunks for p in c.parameters() if p.requires_grad}
    want = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    if dtypes - {want}:
        names = sorted(str(d) for d in dtypes)
        raise ValueError(f"model params are {names} but the optimizer was configured for {want} "
                         "(--bf16/--fp16 must match the model dtype)")


def get_megatron_optimizer(config: OptimizerConfig, model_chunks, pstate) -> MegatronOptimizer:
    """The optimizer for ``model_chunks`` (a list of DDP-wrapped chunks) under ``config``.

    fp32 params: :class:`FP32Optimizer`; bf16/fp16 params: :class:`MixedPrecisionOptimizer` (fp32 main params,
    fp16 loss scaling); ``use_distributed_optimizer``: :class:`DistributedOptimizer` (sharded over DP).
    """
    model_chunks = list(model_chunks)
    _check_chunks(config, model_chunks, pstate)
    groups = build_param_groups(model_chunks, config)
    params = [p for g in groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    scaler = make_grad_scaler(config, device)
    if config.use_distributed_optimizer:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        return DistributedOptimizer(config, lambda gs: make_torch_optimizer(config, gs, device), groups,
                                    model_chunks, pstate, scaler, device)
    if config.bf16 or config.fp16:
        return MixedPrecisionOptimizer(config, lambda gs: make_torch_optimizer(config, gs, device, True), groups,
                                       model_chunks, pstate, scaler, device)
    return FP32Optimizer(config, make_torch_optimizer(config, groups, device), model_chunks, pstate, scaler, device)
