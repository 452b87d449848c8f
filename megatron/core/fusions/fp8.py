"""FP8 linear layers on ``torch._scaled_mm`` with per-tensor current scaling (no Transformer Engine needed).

``--fp8-format e4m3|hybrid`` runs the four GEMM layers of every transformer layer (QKV, projection, FC1, FC2)
in FP8; embeddings, LayerNorms, attention, the output layer and the loss stay in bf16/fp32, as with Transformer
Engine. The recipe is *tensorwise current scaling*: each GEMM operand is scaled by
``scale = fp8_max / amax / 2**margin`` computed from that tensor itself, just before its cast, so there is no
amax history to tune, keep in sync or checkpoint.

- ``e4m3``: activations, weights and output gradients in E4M3 (max 448).
- ``hybrid``: activations and weights in E4M3, output gradients in E5M2 (max 57344: range for gradients).

Per linear ``y = x W^T + b`` (``x [M, K]``, ``W [N, K]``):

- forward (fprop): ``y = (q(x) q(W)^T) / (s_x s_W) + b`` in the activation dtype, with fast accumulation;
- backward: ``dx = q(dy) q(W)`` (dgrad) and ``dW = q(dy)^T q(x)`` (wgrad), both with full-precision (split)
  accumulation, ``dW`` in fp32. With an fp32 ``weight.main_grad`` (the data-parallel wrapper's buffer) ``dW`` goes
  there and the weight gets no ``.grad`` (as with gradient-accumulation fusion): the GEMM writes it directly while
  the slice is marked zero (the first microbatch, ``megatron/core/grad_record.py``), later microbatches add to
  it. Without one, ``dW`` is returned in the weight's dtype.

``_scaled_mm`` wants its first operand row-major and its second column-major, so the cast kernel writes a
transposed FP8 copy from the same tile where a backward GEMM needs one: saved for backward are ``q(x)^T`` (one
byte per element instead of the two of a bf16 ``x``) and ``q(W)^T``.

Overflow is not hidden: a non-finite amax makes the scale NaN, so the GEMM output is NaN and the optimizer's
non-finite-gradient check skips the step. GEMM dimensions (tokens per microbatch, hidden and FFN sizes per TP
rank) must be multiples of 16 (a cuBLAS FP8 requirement); anything else is refused with the sizes named.
On CUDA the cast is a Triton kernel; on CPU (tests) the same arithmetic in PyTorch ops.

``--fp8-recipe delayed`` (Megatron's name; Transformer Engine's default recipe) scales each operand by the amax
its *quantization site* (an operand of one linear: input, weight or output gradient) saw in earlier iterations,
kept in an amax history of ``--fp8-amax-history-len`` steps and reduced by ``--fp8-amax-compute-algo``
(``most_recent`` or ``max``). The cast kernel then needs no amax pass before it: it records the amax of what it
casts for the following steps (an atomic max into the history), which saves one read of every quantized tensor.
:class:`DelayedScaling` holds every site's history and scale in two process-wide device buffers;
``delayed_scaling_step()`` (called by the trainer at the start of each iteration, inside the CUDA graph when
there is one) turns the history into the scales of the new step in a few kernels for all sites together, and
rolls the history. A site uses current (tensorwise) scaling until its first amax has gone through such a step
(its first iteration); checkpoints keep the histories, so a resume continues with the same scales. Values above
the scale's
range saturate, as in Transformer Engine; a non-finite or zero amax keeps the site's previous scale (the step
with the non-finite values is skipped by the non-finite-gradient check, since its casts carry the NaN).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core.fusions.ops import bias_gelu_reference, bias_grad
from megatron.core.grad_record import fused_target, store_grad

try:
    from megatron.core.fusions._triton_fp8 import quantize as _triton_quantize
    from megatron.core.fusions._triton_fp8 import scaled_cast as _triton_scaled_cast
    from megatron.core.fusions._triton_fp8 import scales as _triton_scales

    HAVE_TRITON = True
except ImportError:  # CPU-only machines without triton use the PyTorch cast below
    HAVE_TRITON = False

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FP32_MAX = torch.finfo(torch.float32).max


def grad_dtype(fp8_format: str) -> torch.dtype:
    """The FP8 type of output gradients for a ``--fp8-format``."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"--fp8-format must be one of {', '.join(FP8_FORMATS)}, got {fp8_format}")
    return E5M2 if fp8_format == "hybrid" else E4M3


def scales(x: torch.Tensor, dtype: torch.dtype, margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) as one-element fp32 tensors: ``fp8_max / amax(|x|) / 2**margin``.

    amax 0 gives scale 1; a non-finite amax gives NaN (so the overflow reaches the non-finite-gradient check).
    Everything stays on the device: no host synchronisation (CUDA-graph safe). On CUDA the amax kernel and a
    one-program scale kernel (``quantize`` does not call this: its cast kernel computes the scale itself);
    elsewhere PyTorch ops.
    """
    if HAVE_TRITON and x.is_cuda and x.is_contiguous():
        return _triton_scales(x, dtype, margin)
    return _scales_torch(x, dtype, margin)


def _scales_torch(x: torch.Tensor, dtype: torch.dtype, margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    amax = torch.linalg.vector_norm(x, ord=float("inf")).float().reshape(1)
    scale = torch.div(torch.full_like(amax, torch.finfo(dtype).max / 2.0 ** margin), amax)  # IEEE division
    scale = torch.where(amax > 0, scale.clamp(max=_FP32_MAX), torch.ones_like(amax))
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
    return scale, torch.div(torch.ones_like(scale), scale)


class DelayedScaling:
    """Amax histories and scales of every quantization site under ``--fp8-recipe delayed`` (module docstring).

    Sites are numbered when the model is built (``new_site``, host only); the device buffers are made at the
    first quantization: ``history [L, sites]`` (row 0 collects the current step's amax), and per site its scale
    and 1/scale in rows of 16 bytes (cuBLASLt wants aligned scale pointers).
    """

    UNUSED, RECORDED, READY = 0, 1, 2

    def __init__(self):
        self.history_len, self.algo = None, None
        self.fmax_over_margin: list = []  # per site: fp8_max / 2**margin of its format
        self.state: list = []  # per site: UNUSED / RECORDED (amax in the history) / READY (has a delayed scale)
        self.history = self.scale = self.scale_inv = self.fmax_t = None

    def configure(self, history_len: int, algo: str) -> None:
        if history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {history_len}")
        if algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo must be one of {', '.join(AMAX_COMPUTE_ALGOS)}, got {algo}")
        if self.history_len is not None and (history_len, algo) != (self.history_len, self.algo):
            raise ValueError(f"delayed FP8 scaling is already configured with history {self.history_len} and "
                             f"{self.algo}; this process cannot mix settings (reset_delayed_scaling() first)")
        self.history_len, self.algo = history_len, algo

    def new_site(self, dtype: torch.dtype, margin: int) -> int:
        if self.history is not None:
            raise ValueError("delayed FP8 scaling: a site was added after the first quantization "
                             "(build every model before running one)")
        self.fmax_over_margin.append(torch.finfo(dtype).max / 2.0 ** margin)
        self.state.append(self.UNUSED)
        return len(self.state) - 1

    def _buffers(self, device: torch.device) -> None:
        if self.history is None:
            n = len(self.state)
            self.history = torch.zeros((self.history_len, n), dtype=torch.float32, device=device)
            self.scale = torch.ones((n, 4), dtype=torch.float32, device=device)
            self.scale_inv = torch.ones((n, 4), dtype=torch.float32, device=device)
            self.fmax_t = torch.tensor(self.fmax_over_margin, dtype=torch.float32, device=device)
        elif self.history.device != device:
            raise ValueError(f"delayed FP8 scaling: sites live on {self.history.device}, got a tensor on {device}")

    def site_tensors(self, site: int, device: torch.device):
        """(amax slot of the current step, scale, 1/scale) of a site: one-element views of the buffers."""
        self._buffers(device)
        return self.history[0, site:site + 1], self.scale[site, :1], self.scale_inv[site, :1]

    def step(self) -> None:
        """Start an iteration: each site's scale from its amax history, then roll the history (row 0 emptied)."""
        if self.history is None:
            return
        amax = self.history.amax(0) if self.algo == "max" else self.history[0]
        good = torch.isfinite(amax) & (amax > 0)
        new = torch.div(self.fmax_t, torch.where(good, amax, torch.ones_like(amax))).clamp(max=_FP32_MAX)
        self.scale[:, 0] = torch.where(good, new, self.scale[:, 0])
        self.scale_inv[:, 0] = torch.div(torch.ones_like(new), self.scale[:, 0])
        if self.history_len > 1:
            self.history.copy_(torch.roll(self.history, 1, 0))
        self.history[0].zero_()
        self.state = [self.READY if st != self.UNUSED else st for st in self.state]

    def state_dict(self) -> Optional[dict]:
        """Histories, scales and site states (CPU tensors) for a checkpoint; None before the first quantization."""
        if self.history is None:
            return None
        return {"history_len": self.history_len, "algo": self.algo, "fmax_over_margin": list(self.fmax_over_margin),
                "state": list(self.state), "history": self.history.cpu(), "scale": self.scale.cpu(),
                "scale_inv": self.scale_inv.cpu()}

    def load_state_dict(self, saved: dict, device: torch.device) -> Optional[str]:
        """Restore a checkpoint's state; returns None, or why it does not fit this run (the sites then start
        with current scaling, as in a fresh run)."""
        if not self.state:
            return "this run has no delayed-scaling sites"
        if saved["fmax_over_margin"] != self.fmax_over_margin:
            return (f"the checkpoint has {len(saved['fmax_over_margin'])} sites of other formats or margins than "
                    f"this run's {len(self.state)}")
        if (saved["history_len"], saved["algo"]) != (self.history_len, self.algo):
            return (f"it was saved with --fp8-amax-history-len {saved['history_len']} --fp8-amax-compute-algo "
                    f"{saved['algo']}")
        self._buffers(device)
        for name in ("history", "scale", "scale_inv"):
            getattr(self, name).copy_(saved[name])
        self.state = list(saved["state"])
        return None


_DELAYED = DelayedScaling()


def delayed_site(dtype: torch.dtype, margin: int, history_len: int, algo: str) -> int:
    """A new quantization site under ``--fp8-recipe delayed`` (see :class:`DelayedScaling`)."""
    _DELAYED.configure(history_len, algo)
    return _DELAYED.new_site(dtype, margin)


def delayed_scaling_step() -> None:
    """Called at the start of every training iteration: the delayed scales of the new step (a no-op without
    delayed-scaling sites, and before the first quantization)."""
    _DELAYED.step()


def delayed_scaling_state() -> Optional[dict]:
    """What a checkpoint keeps of delayed scaling (see ``DelayedScaling.state_dict``), or None."""
    return _DELAYED.state_dict()


def load_delayed_scaling_state(saved: dict, device: torch.device) -> Optional[str]:
    """Restore ``delayed_scaling_state()`` from a checkpoint; None, or why it does not fit this run."""
    return _DELAYED.load_state_dict(saved, device)


def reset_delayed_scaling() -> None:
    """Forget every site (tests that build several models with different settings in one process)."""
    global _DELAYED
    _DELAYED = DelayedScaling()


def quantize(x: torch.Tensor, dtype: torch.dtype, margin: int, transpose: bool = False, rows: bool = True,
             gelu: bool = False, bias: Optional[torch.Tensor] = None, site: Optional[int] = None):
    """(q or None, q^T or None, 1/scale) for a 2D ``x``: ``q = saturate(v * scale)`` in ``dtype``, ``v = x``.

    ``rows`` / ``transpose`` choose which of q and q^T are made. With ``gelu`` it quantizes
    ``v = gelu(x + bias)`` (exact GeLU, rounded to ``x``'s dtype): on CUDA the Triton kernels compute the GeLU
    in both passes and never write it in 16 bits. ``site``: a delayed-scaling site (``delayed_site``): its delayed
    scale is used once it has one (else the current amax, as without a site), and the amax of ``v`` is recorded
    into its history.
    """
    x = x.contiguous()  # the Triton kernels index a dense row-major tensor (a no-op for every caller here)
    slot = scale = scale_inv = None
    if site is not None:
        slot, scale, scale_inv = _DELAYED.site_tensors(site, x.device)
        delayed = _DELAYED.state[site] == DelayedScaling.READY
        _DELAYED.state[site] = max(_DELAYED.state[site], DelayedScaling.RECORDED)
        if not delayed:
            scale = scale_inv = None  # current scaling this time; only the amax is recorded
    if HAVE_TRITON and x.is_cuda:
        return _triton_quantize(x, dtype, margin, transpose, rows=rows, gelu=gelu, bias=bias, amax_out=slot,
                                scale=scale, scale_inv=scale_inv)
    if gelu:
        x = bias_gelu_reference(x, bias)
    if scale is None:
        scale, scale_inv = scales(x, dtype, margin)
    if slot is not None:
        amax = torch.linalg.vector_norm(x, ord=float("inf")).float().reshape(1)
        slot.copy_(torch.maximum(slot, torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)))
    fmax = torch.finfo(dtype).max
    q = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    return (q if rows else None), (q.t().contiguous() if transpose else None), scale_inv


def _check_dims(m: int, k: int, n: int) -> None:
    bad = [f"{name} {v}" for name, v in (("tokens", m), ("input features", k), ("output features", n)) if v % 16]
    if bad:
        raise ValueError(f"--fp8-format: FP8 GEMM sizes must be multiples of 16; this linear has {', '.join(bad)} "
                         f"(tokens = micro-batch x sequence length per rank; features per tensor-parallel rank)")


def _mm(a, b, scale_a, scale_b, out_dtype, bias=None, fast_accum=False, out=None) -> torch.Tensor:
    kw = {} if out is None else {"out": out}
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum, **kw)


def new_sites(margin: int, history_len: int, algo: str, fp8_format: str) -> Tuple[int, int, int]:
    """The three delayed-scaling sites of one linear: its input, its weight, its output gradient."""
    return (delayed_site(E4M3, margin, history_len, algo), delayed_site(E4M3, margin, history_len, algo),
            delayed_site(grad_dtype(fp8_format), margin, history_len, algo))


def fprop(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], margin: int, keep_x: bool,
          gelu: bool = False, gelu_bias: Optional[torch.Tensor] = None, sites=None):
    """``x2 [M, K] @ weight^T + bias`` in FP8 (``gelu(x2 + gelu_bias) @ weight^T + bias`` with ``gelu``, see
    ``quantize``). Returns (y [M, N], saved) where ``saved`` is what ``bprop`` needs: (q(x)^T or None when not
    ``keep_x``, 1/s_x, q(W)^T, 1/s_W). ``sites``: the linear's delayed-scaling sites (``new_sites``) or None."""
    _check_dims(x2.shape[0], x2.shape[1], weight.shape[0])
    sx, sw = (sites[0], sites[1]) if sites is not None else (None, None)
    xq, xqt, x_inv = quantize(x2, E4M3, margin, transpose=keep_x, gelu=gelu, bias=gelu_bias, site=sx)
    wq, wqt, w_inv = quantize(weight, E4M3, margin, transpose=True, site=sw)
    y = _mm(xq, wq.t(), x_inv, w_inv, x2.dtype, bias=bias, fast_accum=True)
    return y, (xqt, x_inv, wqt, w_inv)


def bprop(dy2: torch.Tensor, saved, fp8_format: str, margin: int, need_dx: bool, need_dw: bool,
          accumulate_into: Optional[torch.Tensor] = None, sites=None):
    """(dx [M, K] or None, dW [N, K] fp32 or None) for the upstream gradient ``dy2 [M, N]``.

    With ``accumulate_into`` (a weight with an fp32 ``main_grad``) the weight gradient goes into that buffer and
    None is returned for it: written by the GEMM itself while the slice is marked zero (the first microbatch of
    an iteration, ``grad_record.store_grad``), else added to it.
    """
    xqt, x_inv, wqt, w_inv = saved
    dyq, dyqt, dy_inv = quantize(dy2, grad_dtype(fp8_format), margin, transpose=need_dw,
                                 site=sites[2] if sites is not None else None)
    dx = _mm(dyq, wqt.t(), dy_inv, w_inv, dy2.dtype) if need_dx else None
    if not need_dw:
        return dx, None
    if accumulate_into is None or fused_target(accumulate_into) is None:
        return dx, _mm(dyqt, xqt.t(), dy_inv, x_inv, torch.float32)

    def store(main_grad: torch.Tensor, accumulate: bool) -> None:
        if accumulate:
            main_grad.add_(_mm(dyqt, xqt.t(), dy_inv, x_inv, torch.float32))
        else:
            _mm(dyqt, xqt.t(), dy_inv, x_inv, torch.float32, out=main_grad)  # no read-add-write pass over fp32

    store_grad(accumulate_into, store)
    return dx, None


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fp8_format: str, margin: int, accumulate: bool, sites):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        keep_x = ctx.needs_input_grad[1]  # q(x)^T is only needed for the weight gradient
        y, saved = fprop(x2, weight, bias, margin, keep_x=keep_x, sites=sites)
        ctx.sites = sites
        ctx.save_for_backward(*(t for t in saved if t is not None))
        ctx.keep_x, ctx.weight = keep_x, weight
        ctx.fp8_format, ctx.margin, ctx.accumulate, ctx.has_bias = fp8_format, margin, accumulate, bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        saved = saved if ctx.keep_x else (None, *saved)
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = bprop(dy2, saved, ctx.fp8_format, ctx.margin, need_dx, need_dw,
                       accumulate_into=ctx.weight if ctx.accumulate else None, sites=ctx.sites)
        dbias = bias_grad(dy2) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dx = dx.view(*dy.shape[:-1], dx.shape[-1]) if dx is not None else None
        return dx, (dw.to(ctx.weight.dtype) if dw is not None else None), dbias, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fp8_format: str,
               margin: int = 0, accumulate_into_main_grad: bool = True, sites=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs in FP8 (see the module docstring); ``sites``: the
    linear's delayed-scaling sites (``new_sites``), or None for tensorwise current scaling."""
    grad_dtype(fp8_format)  # validates the format
    if torch.compiler.is_compiling():
        raise RuntimeError("--fp8-format cannot run under torch.compile (use the eager transformer layer)")
    return Fp8LinearFunction.apply(x, weight, bias, fp8_format, margin, accumulate_into_main_grad, sites)
