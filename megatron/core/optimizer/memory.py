"""Bytes held per rank by params, main grads, optimizer state and main params (logged at start-up)."""

from __future__ import annotations

from typing import Dict

import torch

from megatron.core.grad_record import main_grad_of


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def optimizer_memory_report(optimizer, model_chunks) -> Dict[str, int]:
    """Return ``{"params", "main_grads", "optimizer_state", "main_params", "total"}`` in bytes on this rank.

    ``params`` are the model params (the distributed optimizer's padded param buffer when present),
    ``main_grads`` the DDP grad buffers (or ``.main_grad``/``.grad`` tensors without DDP), ``main_params`` the
    fp32 copies the optimizer steps (0 when it steps the fp32 model params in place), ``optimizer_state``
    the moment tensors. Before the first step torch optimizers have no state yet; it is then computed from
    the state the optimizer will create (Adam: two fp32 moments per stepped element; SGD: one momentum).
    """
    params = grads = 0
    seen = set()
    for chunk in model_chunks:
        buffers = getattr(chunk, "buffers", None)
        if isinstance(buffers, list):
            for buf in buffers:
                grads += _tensor_bytes(buf.grad_data)
                if buf.param_data is not None:
                    params += _tensor_bytes(buf.param_data)
                    seen.update(id(p) for p in buf.params)
        for p in chunk.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            params += _tensor_bytes(p)
            if not isinstance(buffers, list):
                g = main_grad_of(p)
                g = g if g is not None else p.grad
                grads += _tensor_bytes(g) if g is not None else 0

    torch_opt = optimizer.optimizer
    stepped = [p for g in torch_opt.param_groups for p in g["params"]]
    main_params = sum(_tensor_bytes(p) for p in getattr(optimizer, "owned_main_params", lambda: [])())
    state_bytes = sum(_tensor_bytes(v) for s in torch_opt.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    estimated = not torch_opt.state
    if estimated:
        per_param = 2 if optimizer.config.optimizer == "adam" else (1 if optimizer.config.sgd_momentum else 0)
        state_bytes = per_param * sum(p.numel() for p in stepped) * 4
    return {"params": params, "main_grads": grads, "optimizer_state": state_bytes, "main_params": main_params,
            "total": params + grads + state_bytes + main_params}


def format_memory_report(report: Dict[str, int]) -> str:
    """One log line, sizes in MiB."""
    mib = lambda n: f"{n / 2 ** 20:.2f} MiB"  # noqa: E731
    est = ""
    return (f"memory per rank: params {mib(report['params'])} | main grads {mib(report['main_grads'])} | "
            f"optimizer state {mib(report['optimizer_state'])}{est} | main params {mib(report['main_params'])} | "
            f"total {mib(report['total'])}")
