"""A Llama-option GPT (GQA with query/key norms, RoPE with Llama 3.1 scaling, RMSNorm, SwiGLU, no biases, untied)
with the fused kernels against the same model on the PyTorch references, loss and every gradient (GPU only;
fp32 within 1e-5 relative, as ``test_fused_kernels.py``), with and without selective recomputation of the SwiGLU."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from tests.unit.llama.helpers import batch, built, llama_config  # noqa: E402


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_fused_llama_layers_match_the_references(recompute):
    ids, pos, labels = (t.cuda() for t in batch(b=4, s=16))
    results = []
    for fused in (True, False):
        model = built(llama_config(qk_layernorm=True, use_fused_kernels=fused, recompute_granularity=recompute,
                                   attention_backend="sdpa"))
        loss = model(ids, pos, labels=labels)
        loss.mean().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_f, grads_f), (loss_r, grads_r) = results
    assert _rel(loss_f, loss_r) < 1e-5
    for name, g in grads_r.items():
        assert _rel(grads_f[name], g) < 1e-5, name
