"""AdamW whose update also writes the bf16/fp16 model copy of each parameter: one pass over the optimizer state.

With mixed precision the optimizer steps fp32 main params and the model computes with 16-bit copies. torch's
fused AdamW updates the main params (read p, g, m, v; write p, m, v: 28 bytes per parameter), and a second pass
copies them into the model (read 4, write 2 bytes). :class:`FusedAdamW` does both in one Triton kernel: the
16-bit copy is written from the registers that hold the new fp32 value (30 bytes per parameter instead of 34,
and one launch per param group instead of a multi-tensor launch plus a copy).

It is ``torch.optim.AdamW`` in every other respect:

- the same update (decoupled weight decay ``p -= lr * wd * p``, then ``p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2)
  + eps)``), hyperparameters in ``param_groups`` and a state dict with the same keys (``step``, ``exp_avg``,
  ``exp_avg_sq``), so checkpoints move between the two;
- ``grad_scale`` / ``found_inf`` attributes set before ``step()`` (as for torch's fused AdamW): the grads are
  divided by ``grad_scale`` (clipping folded into the update), and a non-zero ``found_inf`` skips the update
  and the step count, without a host synchronisation;
- ``lr`` may be a device tensor (CUDA-graph capture), and the step count lives on the device.

Each main parameter may name its 16-bit model copy with :meth:`set_model_params`; the optimizer then writes it,
and ``writes_model_params`` tells the mixed-precision wrapper to skip its own copy. The Triton kernel needs CUDA;
elsewhere (CPU tests) the same update runs as PyTorch ops, tensor by tensor (``_adamw_reference``).
``fused_adamw_available()`` says whether the kernel can run (the factory uses this class only then).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    HAVE_TRITON = False

# Elements per program and warps; one program updates one block of one tensor.
ADAMW_CONFIG = {"block": 2048, "num_warps": 4}


def fused_adamw_available(device: torch.device) -> bool:
    return HAVE_TRITON and device.type == "cuda"


if HAVE_TRITON:

    @triton.jit
    def _adamw_math(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, n, lr, bc1, bc2_sqrt, grad_scale, weight_decay, beta1,
                    beta2, eps, MASKED: tl.constexpr, HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr):
        if MASKED:
            mask = offs < n
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        else:
            mask = None
            p = tl.load(p_ptr + offs)
            g = tl.load(g_ptr + offs)
            m = tl.load(m_ptr + offs)
            v = tl.load(v_ptr + offs)
        if HAS_SCALE:
            g = g / grad_scale
        p = p - lr * weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt_rn(v) / bc2_sqrt + eps
        p = p - (lr / bc1) * m / denom
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_OUT:
            tl.store(o_ptr + offs, p.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _adamw_kernel(PTRS, BLK_TENSOR, BLK_START, NUMEL, LR, BIAS_CORR, GRAD_SCALE, FOUND_INF, weight_decay,
                      beta1, beta2, eps, HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                      OUT_BF16: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        """One block of one tensor: PTRS[t] = (param, grad, exp_avg, exp_avg_sq, model copy) addresses;
        BIAS_CORR = (1 - beta1^step, 1 - beta2^step). ALIGNED: every address is a multiple of 16 bytes, so whole
        blocks use unmasked 16-byte accesses (only a tensor's last block is masked)."""
        blk = tl.program_id(0)
        t = tl.load(BLK_TENSOR + blk).to(tl.int64)
        start = tl.load(BLK_START + blk)
        n = tl.load(NUMEL + t)
        a_p = tl.load(PTRS + t * 5 + 0)
        a_g = tl.load(PTRS + t * 5 + 1)
        a_m = tl.load(PTRS + t * 5 + 2)
        a_v = tl.load(PTRS + t * 5 + 3)
        a_o = tl.load(PTRS + t * 5 + 4)
        if ALIGNED:
            start = tl.multiple_of(start, BLOCK)
            a_p = tl.multiple_of(a_p, 16)
            a_g = tl.multiple_of(a_g, 16)
            a_m = tl.multiple_of(a_m, 16)
            a_v = tl.multiple_of(a_v, 16)
            a_o = tl.multiple_of(a_o, 16)
        p_ptr = a_p.to(tl.pointer_type(tl.float32))
        g_ptr = a_g.to(tl.pointer_type(tl.float32))
        m_ptr = a_m.to(tl.pointer_type(tl.float32))
        v_ptr = a_v.to(tl.pointer_type(tl.float32))
        if OUT_BF16:
            o_ptr = a_o.to(tl.pointer_type(tl.bfloat16))
        else:
            o_ptr = a_o.to(tl.pointer_type(tl.float16))
        if HAS_FOUND_INF:  # a skipped step touches nothing
            n = tl.where(tl.load(FOUND_INF) == 0.0, n, 0)
        lr = tl.load(LR)
        bc1 = tl.load(BIAS_CORR)
        bc2_sqrt = tl.sqrt_rn(tl.load(BIAS_CORR + 1))
        grad_scale = tl.load(GRAD_SCALE) if HAS_SCALE else 1.0
        offs = start + tl.arange(0, BLOCK)
        if ALIGNED:
            if start + BLOCK <= n:
                _adamw_math(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, n, lr, bc1, bc2_sqrt, grad_scale,
                            weight_decay, beta1, beta2, eps, MASKED=False, HAS_OUT=HAS_OUT, HAS_SCALE=HAS_SCALE)
            else:
                _adamw_math(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, n, lr, bc1, bc2_sqrt, grad_scale,
                            weight_decay, beta1, beta2, eps, MASKED=True, HAS_OUT=HAS_OUT, HAS_SCALE=HAS_SCALE)
        else:
            _adamw_math(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, n, lr, bc1, bc2_sqrt, grad_scale, weight_decay,
                        beta1, beta2, eps, MASKED=True, HAS_OUT=HAS_OUT, HAS_SCALE=HAS_SCALE)


def _adamw_reference(tensors, lr: torch.Tensor, bias_corr: torch.Tensor, grad_scale: Optional[torch.Tensor],
                     weight_decay: float, beta1: float, beta2: float, eps: float) -> None:
    """The kernel's update in PyTorch ops (no ``found_inf``: the caller skips the step), in place."""
    bc1, bc2_sqrt = bias_corr[0], bias_corr[1].sqrt()
    for p, g, m, v, out in tensors:
        if grad_scale is not None:
            g = g / grad_scale
        p.sub_(lr * weight_decay * p)
        m.mul_(beta1).add_((1.0 - beta1) * g)
        v.mul_(beta2).add_((1.0 - beta2) * g * g)
        p.sub_((lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps))
        if out is not None:
            out.copy_(p)


class _Launch:
    """The device tables of one kernel launch: addresses per tensor and (tensor, start) per block."""

    def __init__(self, tensors: List[Sequence[Optional[torch.Tensor]]], aligned: bool, block: int,
                 device: torch.device):
        ptrs, numel, blk_tensor, blk_start = [], [], [], []
        for i, ts in enumerate(tensors):
            ptrs.extend(t.data_ptr() if t is not None else 0 for t in ts)
            n = ts[0].numel()
            numel.append(n)
            nblocks = -(-n // block)
            blk_tensor.extend([i] * nblocks)
            blk_start.extend(range(0, nblocks * block, block))
        self.aligned = aligned
        self.ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self.numel = torch.tensor(numel, dtype=torch.int64, device=device)
        self.blk_tensor = torch.tensor(blk_tensor, dtype=torch.int32, device=device)
        self.blk_start = torch.tensor(blk_start, dtype=torch.int64, device=device)
        self.num_blocks = len(blk_tensor)


class _GroupPlan:
    """One param group's launches: the tensors whose five addresses are all 16-byte aligned get the kernel with
    unmasked vector accesses, the others (a view at an odd offset, say) the masked one."""

    def __init__(self, key: tuple, tensors: List[Sequence[Optional[torch.Tensor]]], block: int,
                 device: torch.device):
        self.key = key
        aligned = [all(t is None or t.data_ptr() % 16 == 0 for t in ts) for ts in tensors]
        self.launches = [_Launch([ts for ts, a in zip(tensors, aligned) if a == want], want, block, device)
                         for want in (True, False) if want in aligned]


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay) stepped by one Triton kernel per param group, which also
    writes each parameter's 16-bit model copy (see the module docstring). Params: fp32 tensors."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 capturable: bool = False):
        # fused=True: the state's step lives on the device (also after load_state_dict), and MegatronOptimizer
        # folds clipping into the update (grad_scale) as it does for torch's fused AdamW.
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True,
                         capturable=capturable)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"FusedAdamW steps fp32 params, got {p.dtype}")
        self._model_params: Dict[int, torch.Tensor] = {}
        self._plans: Dict[int, _GroupPlan] = {}
        self._lr_buffers: Dict[int, torch.Tensor] = {}
        self._betas: Dict[tuple, torch.Tensor] = {}

    @property
    def writes_model_params(self) -> bool:
        return bool(self._model_params)

    def set_model_params(self, pairs) -> None:
        """``pairs``: ``(main_param, model_param)``; each step then writes ``model_param`` (bf16/fp16, same shape)."""
        for main, model in pairs:
            if model.shape != main.shape or model.dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"model copy must be bf16/fp16 of shape {tuple(main.shape)}, "
                                 f"got {model.dtype} {tuple(model.shape)}")
            if not model.is_contiguous() or not main.is_contiguous():
                raise ValueError("FusedAdamW needs contiguous main and model params")
            self._model_params[id(main)] = model
        dtypes = {m.dtype for m in self._model_params.values()}
        if len(dtypes) > 1:
            raise ValueError(f"model copies of one optimizer must share a dtype, got {sorted(map(str, dtypes))}")
        self._plans.clear()

    def state_dict(self) -> dict:
        """torch's state dict, each param with its own ``step`` tensor: the step shared within a group here would
        otherwise load as one tensor that torch's AdamW increments once per param."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v, step=v["step"].clone()) if "step" in v else v for k, v in sd["state"].items()}
        return sd

    def _state_of(self, p: torch.Tensor, group_step: Optional[torch.Tensor]) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = group_step if group_step is not None else torch.zeros((), dtype=torch.float32,
                                                                                  device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _lr_tensor(self, index: int, group: dict, device: torch.device) -> torch.Tensor:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            return lr.to(device=device, dtype=torch.float32).reshape(1)
        buf = self._lr_buffers.get(index)
        if buf is None:
            buf = self._lr_buffers[index] = torch.empty(1, dtype=torch.float32, device=device)
        buf.fill_(float(lr))  # a kernel argument, not a host-to-device copy
        return buf

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for index, group in enumerate(self.param_groups):
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("FusedAdamW supports neither amsgrad nor maximize")
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            device = params[0].device
            # One step count per group, shared by its params' states (a checkpoint may hold separate copies).
            first = self.state[params[0]]
            step = first.get("step")
            if step is not None and (not isinstance(step, torch.Tensor) or step.device != device):
                step = first["step"] = torch.as_tensor(step, dtype=torch.float32).to(device).reshape(())
            tensors = []
            for p in params:
                state = self._state_of(p, step)
                if step is None:
                    step = state["step"]
                if state["step"] is not step:
                    state["step"] = step
                if p.grad.dtype != torch.float32 or not p.grad.is_contiguous():
                    raise ValueError("FusedAdamW needs contiguous fp32 grads")
                tensors.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"], self._model_params.get(id(p))))
            has_out = all(ts[4] is not None for ts in tensors)
            if not has_out and any(ts[4] is not None for ts in tensors):
                raise ValueError("FusedAdamW: either every or no param of a group has a model copy")
            if found_inf is not None:
                step.add_(1.0 - found_inf.to(step.dtype).reshape(()))
            else:
                step.add_(1.0)
            beta1, beta2 = group["betas"]
            lr = self._lr_tensor(index, group, device)
            betas = self._betas.get((beta1, beta2))
            if betas is None:  # made on the first (eager) step, never while a CUDA graph is captured
                betas = self._betas[(beta1, beta2)] = torch.tensor([beta1, beta2], dtype=torch.float64,
                                                                   device=device)
            # 1 - beta^step computed in float64 on the device: no host synchronisation, graph-capturable
            bias_corr = (1.0 - betas.pow(step)).to(torch.float32)
            if not fused_adamw_available(device):
                if found_inf is None or not bool(found_inf):
                    _adamw_reference(tensors, lr, bias_corr, grad_scale, float(group["weight_decay"]), beta1,
                                     beta2, float(group["eps"]))
                continue
            key = tuple(t.data_ptr() if t is not None else 0 for ts in tensors for t in ts)
            plan = self._plans.get(index)
            if plan is None or plan.key != key:
                plan = self._plans[index] = _GroupPlan(key, tensors, ADAMW_CONFIG["block"], device)
            for launch in plan.launches:
                _adamw_kernel[(launch.num_blocks,)](
                    launch.ptrs, launch.blk_tensor, launch.blk_start, launch.numel, lr, bias_corr,
                    grad_scale if grad_scale is not None else lr, found_inf if found_inf is not None else lr,
                    float(group["weight_decay"]), float(beta1), float(beta2), float(group["eps"]),
                    HAS_OUT=has_out, HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
                    OUT_BF16=has_out and tensors[0][4].dtype == torch.bfloat16, ALIGNED=launch.aligned,
                    BLOCK=ADAMW_CONFIG["block"], num_warps=ADAMW_CONFIG["num_warps"])
        return loss
