"""Options Hugging Face's Llama has no model for (per-head query/key norms, multi-query attention, partial and
interleaved rotary, kv_channels unequal to hidden/heads, biases with SwiGLU, LayerNorm + GeLU with rotary) against
a plain PyTorch transformer written here from the full state dict, head by head; and selective recomputation of
the SwiGLU against none."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.model_counts import chunk_param_numels
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from tests.unit.llama.helpers import VOCAB, batch, built, llama_config


def _norm(x, sd, prefix, cfg):
    w = sd[prefix + ".weight"]
    if cfg.normalization == "RMSNorm":
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w
    return F.layer_norm(x, x.shape[-1:], w, sd[prefix + ".bias"], cfg.layernorm_epsilon)


def _rotate(x, positions, cfg):
    """x [b, s, d] of one head; rotates the first kv_channels * rotary_percent channels, pair by pair."""
    d = x.shape[-1]
    r = int(d * cfg.rotary_percent)
    out = x.clone()
    for j in range(r // 2):
        theta = cfg.rotary_base ** (-2.0 * j / r)
        if cfg.use_rope_scaling:
            # this hand-written reference has no Llama 3.1 scaling; test_hf_parity.py checks that option
            raise ValueError("the plain reference does not implement --use-rope-scaling")
        i1, i2 = (2 * j, 2 * j + 1) if cfg.rotary_interleaved else (j, j + r // 2)
        angle = positions.double()[None, :] * theta  # [1, s]
        cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
        out[..., i1] = x[..., i1] * cos - x[..., i2] * sin
        out[..., i2] = x[..., i2] * cos + x[..., i1] * sin
    return out


def reference_logits(sd, cfg, ids):
    """Logits [b, s, padded vocab] of the model whose full state dict is ``sd``."""
    b, s = ids.shape
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    positions = torch.arange(s)
    x = sd["embedding.word_embeddings.weight"][ids]  # [b, s, h]
    if cfg.position_embedding_type == "learned_absolute":
        x = x + sd["embedding.position_embeddings.weight"][positions]
    causal = torch.ones(s, s, dtype=torch.bool).tril()

    def lin(t, prefix, bias):
        w = sd[prefix + ".weight"]
        return t @ w.t() + (sd[prefix + ".bias"] if bias else 0)

    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        hn = _norm(x, sd, p + "input_layernorm", cfg)
        qkv = lin(hn, p + "self_attention.linear_qkv", cfg.add_bias_linear or cfg.add_qkv_bias)
        per_group = (n // g + 2) * d
        heads = []
        for head in range(n):
            grp = head // (n // g)
            base = grp * per_group
            q = qkv[..., base + (head % (n // g)) * d: base + (head % (n // g) + 1) * d]
            k = qkv[..., base + (n // g) * d: base + (n // g + 1) * d]
            v = qkv[..., base + (n // g + 1) * d: base + (n // g + 2) * d]
            if cfg.qk_layernorm:
                q = _norm(q, sd, p + "self_attention.q_layernorm", cfg)
                k = _norm(k, sd, p + "self_attention.k_layernorm", cfg)
            if cfg.position_embedding_type == "rope":
                q, k = _rotate(q, positions, cfg), _rotate(k, positions, cfg)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # [b, s, s]
            scores = scores.masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v)  # [b, s, d]
        x = x + lin(torch.cat(heads, -1), p + "self_attention.linear_proj", cfg.add_bias_linear)
        hn = _norm(x, sd, p + "pre_mlp_layernorm", cfg)
        inter = lin(hn, p + "mlp.linear_fc1", cfg.add_bias_linear)
        if cfg.gated_linear_unit:
            gate, up = inter.chunk(2, -1)
            act = F.silu(gate) * up
        else:
            act = F.gelu(inter)
        x = x + lin(act, p + "mlp.linear_fc2", cfg.add_bias_linear)
    x = _norm(x, sd, "decoder.final_layernorm", cfg)
    out_w = sd["embedding.word_embeddings.weight" if cfg.share_embeddings_and_output_weights else "output_layer.weight"]
    return x @ out_w.t()


CASES = {
    "mqa_qknorm_partial_interleaved": dict(num_query_groups=1, qk_layernorm=True, rotary_percent=0.5,
                                           rotary_interleaved=True, use_rope_scaling=False),
    "kv_channels_biases_swiglu": dict(kv_channels=24, add_bias_linear=True, use_rope_scaling=False,
                                      rotary_base=10000, share_embeddings_and_output_weights=True),
    "layernorm_gelu_rope_qknorm": dict(normalization="LayerNorm", gated_linear_unit=False, activation="gelu",
                                       add_bias_linear=True, qk_layernorm=True, use_rope_scaling=False,
                                       num_query_groups=4),
    "no_position_embedding_qkv_bias": dict(position_embedding_type="none", use_rope_scaling=False, add_qkv_bias=True,
                                           num_query_groups=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_logits_equal_plain_reference(case, backend):
    cfg = llama_config(attention_backend=backend, **CASES[case])
    model = built(cfg).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a mix-up shows
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    ids, pos, _ = batch()
    with torch.no_grad():
        got = model(ids, pos)
        want = reference_logits(model.state_dict(), cfg, ids)
    torch.testing.assert_close(got[..., :VOCAB], want[..., :VOCAB], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gated", [True, False])
def test_selective_recompute_of_the_activation_changes_nothing(gated):
    act = dict(gated_linear_unit=True, activation="silu") if gated else dict(gated_linear_unit=False,
                                                                            activation="gelu")
    plain, recomputed = (built(llama_config(add_bias_linear=True, **act, **kw))
                         for kw in ({}, dict(recompute_granularity="selective", recompute_modules=("mlp_act",))))
    assert recomputed.decoder.layers[0].mlp.recompute_act and not plain.decoder.layers[0].mlp.recompute_act
    ids, pos, labels = batch()
    losses = [m(ids, pos, labels=labels) for m in (plain, recomputed)]
    for loss in losses:
        loss.mean().backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    grads = dict(recomputed.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", sorted(CASES) + ["llama"])
@pytest.mark.parametrize("stage", [(True, True), (True, False), (False, True)])
def test_parameter_counts_are_the_built_models(case, stage):
    """``model_counts`` (the log line, --dry-run and the planner count with it) equals the built chunk's
    parameters, in registration order, for every option set and pipeline stage."""
    cfg = llama_config(**CASES.get(case, {}))
    pre, post = stage
    model = GPTModel(cfg, ParallelState.single(), pre_process=pre, post_process=post, num_layers=1)
    want = chunk_param_numels(cfg.spec, 1, 1, pre=pre, post=post)
    assert [p.numel() for p in model.parameters()] == want
