"""The GPT model against an independent plain-PyTorch reference written from the math, not from our modules."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.core.models.init import initialize_model_parameters
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig


def reference_gpt_logits(sd: dict, ids: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    """Pre-LN GPT from a Megatron-Core-named state dict: ids [b, s] -> logits [b, s, V]."""
    b, s = ids.shape
    h, n = cfg.hidden_size, cfg.num_attention_heads
    d = h // n
    x = sd["embedding.word_embeddings.weight"][ids] + sd["embedding.position_embeddings.weight"][:s]
    for i in range(cfg.num_layers):
        p = lambda k: sd[f"decoder.layers.{i}.{k}"]  # noqa: E731
        y = F.layer_norm(x, (h,), p("input_layernorm.weight"), p("input_layernorm.bias"), cfg.layernorm_epsilon)
        qkv = y @ p("self_attention.linear_qkv.weight").T + p("self_attention.linear_qkv.bias")
        qkv = qkv.view(b, s, n, 3, d)  # Megatron-Core rows: per head [q k v]
        q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))  # [b, n, s, d]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = att.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        ctx = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + ctx @ p("self_attention.linear_proj.weight").T + p("self_attention.linear_proj.bias")
        y = F.layer_norm(x, (h,), p("pre_mlp_layernorm.weight"), p("pre_mlp_layernorm.bias"), cfg.layernorm_epsilon)
        y = F.gelu(y @ p("mlp.linear_fc1.weight").T + p("mlp.linear_fc1.bias"))
        x = x + y @ p("mlp.linear_fc2.weight").T + p("mlp.linear_fc2.bias")
    x = F.layer_norm(x, (h,), sd["decoder.final_layernorm.weight"], sd["decoder.final_layernorm.bias"],
                     cfg.layernorm_epsilon)
    return x @ sd["embedding.word_embeddings.weight"].T


@pytest.fixture(autouse=True)
def _seed():
    model_parallel_seed(1234, ParallelState.single())


def _config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=128,
                attention_dropout=0.0, hidden_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_gpt_matches_plain_reference(backend):
    cfg = _config(attention_backend=backend)
    ps = ParallelState.single()
    model = GPTModel(cfg, ps)
    initialize_model_parameters(model, 7, cfg, ps)
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(3, 16)
    logits = model(ids, pos)
    ref = reference_gpt_logits(model.state_dict(), ids, cfg)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    loss = model(ids, pos, labels=ids.roll(-1, 1))
    ref_loss = F.cross_entropy(ref.reshape(-1, 128), ids.roll(-1, 1).reshape(-1), reduction="none").view(3, 16)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
def test_single_kernel_backends_refuse_cpu_tensors(backend):
    model = GPTModel(_config(attention_backend=backend), ParallelState.single())
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=f"attention backend {backend} needs CUDA"):
        model(ids, torch.arange(16).expand(2, 16))


def test_unknown_attention_backend_is_named():
    with pytest.raises(ValueError, match="attention backend must be one of sdpa, flash, cudnn, unfused, got xformers"):
        _config(attention_backend="xformers")


def test_parameter_names_follow_megatron_core():
    cfg = _config(num_layers=1)
    names = set(GPTModel(cfg, ParallelState.single()).state_dict())
    expected = {
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.bias",
        "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_qkv.bias",
        "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.self_attention.linear_proj.bias",
        "decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.bias",
        "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.bias",
        "decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.0.mlp.linear_fc2.bias",
        "decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
    }
    assert names == expected
    untied = set(GPTModel(_config(num_layers=1, share_embeddings_and_output_weights=False),
                          ParallelState.single()).state_dict())
    assert untied == expected | {"output_layer.weight"}


def test_init_statistics_and_layout_independence_of_names():
    cfg = _config(num_layers=4)
    ps = ParallelState.single()
    full = GPTModel(cfg, ps)
    initialize_model_parameters(full, 3, cfg, ps)
    sd = full.state_dict()
    # scaled init of the residual-branch output projections, plain init elsewhere
    std_proj = sd["decoder.layers.0.self_attention.linear_proj.weight"].std().item()
    std_qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"].std().item()
    assert abs(std_qkv - 0.02) < 0.003
    assert abs(std_proj - 0.02 / math.sqrt(8)) < 0.002
    assert torch.all(sd["decoder.layers.1.input_layernorm.weight"] == 1)
    assert torch.all(sd["decoder.layers.1.mlp.linear_fc1.bias"] == 0)
    # a second chunk holding layers 2..3 (a pipeline stage) gets exactly layers 2..3 of the full model
    stage = GPTModel(cfg, ps, pre_process=False, post_process=True, num_layers=2, layer_offset=2)
    initialize_model_parameters(stage, 3, cfg, ps, layer_offset=2)
    for name, value in stage.state_dict().items():
        if name.startswith("decoder.layers."):
            i = int(name.split(".")[2])
            full_name = name.replace(f"decoder.layers.{i}.", f"decoder.layers.{i + 2}.")
            torch.testing.assert_close(value, sd[full_name], rtol=0, atol=0)
    torch.testing.assert_close(stage.state_dict()["output_layer.weight"], sd["embedding.word_embeddings.weight"])


@pytest.mark.parametrize("granularity,method", [("selective", None), ("full", "uniform"), ("full", "block")])
def test_recompute_gives_same_gradients(granularity, method):
    ps = ParallelState.single()
    grads = []
    for g, m in ((None, None), (granularity, method)):
        cfg = _config(num_layers=3, recompute_granularity=g, recompute_method=m, recompute_num_layers=2)
        model = GPTModel(cfg, ps)
        initialize_model_parameters(model, 11, cfg, ps)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        model(ids, torch.arange(16).expand(2, 16), labels=ids).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-6, atol=1e-7)


def test_selective_recompute_limited_to_first_layers():
    ps = ParallelState.single()
    cfg = _config(num_layers=3, recompute_granularity="selective", recompute_num_layers=2,
                  recompute_modules=("mlp_act",))
    model = GPTModel(cfg, ps)
    flags = [(layer.self_attention.recompute_core, layer.mlp.recompute_act)
             for layer in model.decoder.layers]
    assert flags == [(False, True), (False, True), (False, False)]
    every = GPTModel(_config(num_layers=3, recompute_granularity="selective"), ps)
    assert all(layer.mlp.recompute_act and layer.self_attention.recompute_core
               for layer in every.decoder.layers)
    with pytest.raises(ValueError, match="--recompute-num-layers must be >= 1"):
        _config(num_layers=3, recompute_granularity="selective", recompute_num_layers=0)
