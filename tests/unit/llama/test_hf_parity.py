"""Our GPTModel with the Llama options against Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM /
MistralForCausalLM (fp32 logits to 1e-5), through the weight mapping in both directions."""

import pytest
import torch

from megatron.core.checkpoint_formats.hf_llama_weights import from_hf_llama, to_hf_llama
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from tests.unit.llama.helpers import PADDED_VOCAB, VOCAB, batch, built, llama_config

transformers = pytest.importorskip("transformers")

ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _hf_model(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=131072,
                  attn_implementation="eager")
    torch.manual_seed(3)
    if kind == "llama":
        cfg = transformers.LlamaConfig(rope_parameters=ROPE_LLAMA3, tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                         tie_word_embeddings=False, sliding_window=None, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                       tie_word_embeddings=True, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a swapped mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _our_config(kind: str):
    if kind == "llama":
        return llama_config()
    if kind == "mistral":
        return llama_config(rotary_base=1000000, use_rope_scaling=False)
    return llama_config(rotary_base=1000000, use_rope_scaling=False, add_qkv_bias=True,
                        share_embeddings_and_output_weights=True)


def _logits(model: GPTModel, ids, pos):
    with torch.no_grad():
        return model(ids, pos)[..., :VOCAB]  # [b, s, V] (padding rows left out)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_logits_equal_hugging_face(kind):
    hf = _hf_model(kind)
    cfg = _our_config(kind)
    ours = GPTModel(cfg, ParallelState.single()).eval()
    hf_sd = hf.state_dict()
    full = from_hf_llama(hf_sd, cfg, PADDED_VOCAB)
    ours.load_state_dict(full, strict=True)
    ids, pos, _ = batch()
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    torch.testing.assert_close(_logits(ours, ids, pos), want, rtol=1e-5, atol=1e-5)
    # and back: our weights written out are Hugging Face's, key for key
    back = to_hf_llama(ours.state_dict(), cfg, VOCAB)
    expected = {k: v for k, v in hf_sd.items() if not (kind == "qwen2" and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("interleaved", [False, True])
def test_our_initialised_model_exported_equals_hugging_face(interleaved):
    """Our own initialisation, exported, runs in LlamaForCausalLM with equal logits (the export direction); an
    interleaved-rotary model's query/key rows are permuted to Hugging Face's half-rotation layout and back."""
    cfg = llama_config(rotary_interleaved=interleaved)
    ours = built(cfg).eval()
    hf = _hf_model("llama")
    hf.load_state_dict(to_hf_llama(ours.state_dict(), cfg, VOCAB), strict=True)
    ids, pos, _ = batch(seed=1)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    torch.testing.assert_close(_logits(ours, ids, pos), want, rtol=1e-5, atol=1e-5)
    back = from_hf_llama(hf.state_dict(), cfg, PADDED_VOCAB)
    for k, v in ours.state_dict().items():  # the vocabulary padding rows do not travel
        rows = VOCAB if k in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(back[k][:rows], v[:rows]), k


def test_options_hugging_face_llama_cannot_hold_are_refused():
    with pytest.raises(CheckpointFormatError, match="--qk-layernorm"):
        to_hf_llama({}, llama_config(qk_layernorm=True), VOCAB)
    with pytest.raises(CheckpointFormatError, match="--swiglu"):
        from_hf_llama({}, llama_config(gated_linear_unit=False, activation="gelu"), PADDED_VOCAB)
    with pytest.raises(CheckpointFormatError, match="lack model.layers.0.input_layernorm.weight"):
        from_hf_llama({"model.embed_tokens.weight": torch.zeros(VOCAB, 64)}, llama_config(), PADDED_VOCAB)
