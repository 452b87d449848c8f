"""Each SDPA attention backend (PyTorch's choice, flash only, cuDNN only) against the explicit unfused path, in
our layout (q, k, v are strided views of one ``[s, b, n, 3d]`` QKV tensor), forward and backward (GPU only).

bf16 results are compared with the unfused path run in fp32 (relative Frobenius error within 1e-2).
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from megatron.core.transformer.attention import CoreAttention  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402


def _core(backend: str, n: int, d: int, s: int) -> CoreAttention:
    cfg = TransformerConfig(num_layers=1, hidden_size=n * d, num_attention_heads=n, seq_length=s,
                            padded_vocab_size=128, attention_dropout=0.0, hidden_dropout=0.0,
                            attention_backend=backend)
    return CoreAttention(cfg).cuda()


def _run(core: CoreAttention, qkv: torch.Tensor, grad: torch.Tensor, d: int):
    qkv = qkv.detach().requires_grad_()
    q, k, v = qkv.split(d, dim=-1)  # the strided per-head views SelfAttention hands to the core
    out = core(q, k, v)
    out.backward(grad)
    return out.detach().float(), qkv.grad.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", ["sdpa", "flash", "cudnn"])
@pytest.mark.parametrize("s,b,n,d", [(512, 2, 4, 64), (256, 3, 2, 128)])
def test_backend_matches_unfused(backend, s, b, n, d):
    torch.manual_seed(0)
    qkv = torch.randn(s, b, n, 3 * d, device="cuda")
    grad = torch.randn(s, b, n * d, device="cuda")
    ref_out, ref_grad = _run(_core("unfused", n, d, s), qkv, grad, d)
    out, g = _run(_core(backend, n, d, s), qkv.bfloat16(), grad.bfloat16(), d)
    assert _rel(out, ref_out) < 1e-2
    assert _rel(g, ref_grad) < 1e-2
