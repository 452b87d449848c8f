"""Memory-lean vocabulary cross-entropy for the unsharded (TP=1) output layer.

``fused_vocab_cross_entropy(logits [s, b, V], target [s, b]) -> loss [s, b]`` (fp32) computes
``logsumexp(logits) - logits[target]`` per token without ever materialising an fp32 copy of the
``s x b x V`` logits:

- on CUDA with Triton, one program per token streams its row in chunks (online max / sum-exp in fp32) and keeps
  only the fp32 log-sum-exp per token (4 bytes) for backward; backward streams the row again and writes
  ``(softmax - onehot) * dloss`` in the logits dtype;
- elsewhere (CPU, or no Triton) the same algorithm runs in PyTorch over row chunks whose fp32 working copy is
  bounded by ``chunk_bytes``.

By default the gradient is written into the logits' own storage (``inplace_backward=True``): the logits are a
temporary that only this loss consumes, so this saves a second ``s x b x V`` buffer at the memory peak. Pass
``inplace_backward=False`` when the caller keeps using the logits after backward.

``cross_entropy_reference`` is the plain PyTorch definition the fused paths are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional: the chunked PyTorch path serves CPUs and machines without it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

_CHUNK_BYTES = 256 * 1024 * 1024


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss [s, b] in fp32 via F.cross_entropy on an fp32 copy of the logits."""
    v = logits.shape[-1]
    loss = F.cross_entropy(logits.float().reshape(-1, v), target.reshape(-1), reduction="none",
                           ignore_index=ignore_index)
    return loss.view(target.shape)


if HAVE_TRITON:

    @triton.jit
    def _ce_fwd_kernel(LOGITS, TARGET, LOSS, LSE, stride, V, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * stride
        cols = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)  # running max per lane
        s = tl.zeros((BLOCK,), tl.float32)  # running sum of exp(x - m) per lane
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            # One exp per element: for a new lane maximum (d > 0) the sum rescales by exp(m - x) and gains 1,
            # otherwise it gains exp(x - m); both are exp(-|d|). d is NaN only when x and m are both -inf
            # (a lane that has seen nothing else), which adds nothing. (Two exps per element, the textbook
            # update, made this kernel bound by the exp unit rather than by memory.)
            d = x - m
            e = tl.exp(-tl.abs(d))
            e = tl.where(d == d, e, 0.0)
            s = tl.where(d > 0, s * e + 1.0, s + e)
            m = tl.maximum(m, x)
        row_max = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - row_max), axis=0)
        lse = row_max + tl.log(total)
        t = tl.load(TARGET + row)
        valid = t != ignore_index
        t_safe = tl.where(valid, t, 0)
        x_t = tl.load(base + t_safe).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
        tl.store(LSE + row, lse)

    @triton.jit
    def _ce_bwd_kernel(LOGITS, GRAD, TARGET, LSE, DLOSS, stride_l, stride_g, V, ignore_index,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(TARGET + row)
        lse = tl.load(LSE + row)
        dl = tl.load(DLOSS + row).to(tl.float32)
        dl = tl.where(t != ignore_index, dl, 0.0)
        cols = tl.arange(0, BLOCK)
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(LOGITS + row * stride_l + c, mask=c < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)
            tl.store(GRAD + row * stride_g + c, (g * dl).to(GRAD.dtype.element_ty), mask=c < V)


def _chunk_rows(v: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * v))


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, inplace_backward: bool,
                chunk_bytes: int):
        v = logits.shape[-1]
        l2 = logits.reshape(-1, v)  # [N, V]
        if l2.stride(-1) != 1:
            l2 = l2.contiguous()
        t = target.reshape(-1).contiguous()  # [N]
        n = l2.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        use_triton = HAVE_TRITON and l2.is_cuda
        if use_triton and n:
            _ce_fwd_kernel[(n,)](l2, t, loss, lse, l2.stride(0), v, ignore_index, BLOCK=4096, num_warps=8)
        else:
            for i in range(0, n, _chunk_rows(v, chunk_bytes)):
                j = min(n, i + _chunk_rows(v, chunk_bytes))
                chunk = l2[i:j].float()  # [rows, V] fp32, bounded by chunk_bytes
                lse[i:j] = torch.logsumexp(chunk, dim=-1)
                valid = t[i:j] != ignore_index
                x_t = chunk.gather(1, torch.where(valid, t[i:j], 0).unsqueeze(1)).squeeze(1)
                loss[i:j] = torch.where(valid, lse[i:j] - x_t, 0.0)
        ctx.save_for_backward(l2, t, lse)
        ctx.ignore_index, ctx.inplace, ctx.chunk_bytes = ignore_index, inplace_backward, chunk_bytes
        ctx.use_triton, ctx.logits_shape = use_triton, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        l2, t, lse = ctx.saved_tensors
        n, v = l2.shape
        dl = dloss.reshape(-1).contiguous()
        grad = l2 if ctx.inplace else torch.empty_like(l2)
        if ctx.use_triton and n:
            _ce_bwd_kernel[(n,)](l2, grad, t, lse, dl, l2.stride(0), grad.stride(0), v, ctx.ignore_index,
                                 BLOCK=4096, num_warps=8)
        else:
            rows = _chunk_rows(v, ctx.chunk_bytes)
            for i in range(0, n, rows):
                j = min(n, i + rows)
                p = torch.exp(l2[i:j].float() - lse[i:j, None])  # [rows, V] softmax
                valid = t[i:j] != ctx.ignore_index
                idx = torch.where(valid, t[i:j], 0).unsqueeze(1)
                p.scatter_add_(1, idx, torch.full_like(idx, -1, dtype=p.dtype))
                p.mul_(torch.where(valid, dl[i:j].float(), 0.0)[:, None])
                grad[i:j] = p.to(grad.dtype)
        return grad.view(ctx.logits_shape), None, None, None, None


def fused_vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                              inplace_backward: bool = True, chunk_bytes: int = _CHUNK_BYTES) -> torch.Tensor:
    """Per-token cross-entropy [s, b] (fp32) of logits [s, b, V] against integer targets [s, b].

    Tokens whose target equals ``ignore_index`` get loss 0 and gradient 0. Under ``torch.compile`` tracing the
    plain definition is used (Inductor generates its own fused kernel).
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"fused_vocab_cross_entropy: logits shape {tuple(logits.shape)} does not match "
                         f"target shape {tuple(target.shape)} + [V]")
    if torch.compiler.is_compiling():
        return cross_entropy_reference(logits, target, ignore_index)
    return _VocabCrossEntropy.apply(logits, target, ignore_index, inplace_backward, chunk_bytes)
