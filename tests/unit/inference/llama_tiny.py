"""Small random Hugging Face Llama-family models, a Llama-3-style ``tokenizer.json`` for them, and their weights
converted into our checkpoint layout, for the inference tests.

``llama``: grouped-query attention (4 heads, 2 key/value groups), RoPE θ = 500,000 with Llama 3.1's scaling,
RMSNorm, SwiGLU, no biases, untied output layer. ``qwen2``: the same with a bias on the QKV projection, θ = 10^6 and
a tied output layer.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from megatron.core.checkpoint_formats.common import SPEC_KEY
from megatron.core.checkpoint_formats.hf_llama import from_hf_llama
from megatron.core.inference import InferenceEngine, SamplingParams, load_gpt_for_inference, save_gpt_checkpoint
from megatron.core.model_spec import ModelSpec
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig

WORDS = ("the a of and to in is was he she it they we king queen lord lady crown sword tower night day love death "
         "heart blood fair sweet sorrow speak come go see hear know tell give take make stand fall rise bring "
         "keep leave call find , . ! ? ; :").split()
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SEQ = 64


def write_tokenizer(folder: str) -> str:
    """A word-level ``tokenizer.json`` whose post-processor puts ``<|begin_of_text|>`` first, as Llama 3's does,
    and its ``tokenizer_config.json``; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate([BOS, EOS, "<unk>"] + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)
    return folder


def vocab_size() -> int:
    return 3 + len(WORDS)


def spec(kind: str, padded_vocab_size: int) -> ModelSpec:
    """Our description of the Hugging Face model ``hf_model(kind)`` builds."""
    common = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=padded_vocab_size,
                  normalization="RMSNorm", layernorm_epsilon=1e-5, position_embedding_type="rope",
                  gated_linear_unit=True, activation="silu", add_bias_linear=False)
    if kind == "llama":
        return ModelSpec(rotary_base=500000, use_rope_scaling=True, share_embeddings_and_output_weights=False,
                         **common)
    return ModelSpec(rotary_base=1000000, add_qkv_bias=True, share_embeddings_and_output_weights=True, **common)


def hf_model(kind: str):
    """A random ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` in eval mode, weights larger than the default
    initialisation so that greedy choices are clear-cut and vary along a sequence."""
    import transformers

    common = dict(vocab_size=vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  max_position_embeddings=131072,  # Llama 3.1's; rotary angles do not depend on it
                  initializer_range=0.15, attn_implementation="eager", bos_token_id=0, eos_token_id=1)
    torch.manual_seed(5)
    if kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_parameters=rope,
                                                                       tie_word_embeddings=False, **common))
    else:
        rope = {"rope_type": "default", "rope_theta": 1000000.0}
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_parameters=rope, tie_word_embeddings=True,
                                                                       **common))
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a swapped mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def write_checkpoint(kind: str, hf, root: str, tokenizer_folder: str) -> str:
    """The Hugging Face model's weights in our checkpoint layout (one rank), with its description and tokenizer."""
    model_spec = spec(kind, padded_vocab_size=128)
    full = from_hf_llama({k: v.detach() for k, v in hf.state_dict().items()}, model_spec, 128)
    ours = GPTModel(TransformerConfig.from_spec(model_spec, attention_dropout=0.0, hidden_dropout=0.0),
                    ParallelState.single())
    ours.load_state_dict(full, strict=True)
    args = {SPEC_KEY: model_spec.to_dict(), "padded_vocab_size": 128, "params_dtype": "float32",
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer_folder}
    save_gpt_checkpoint(root, 1, [ours], args)
    return root


def cached_equals_recomputed(rank, world_size, ckpt, tp, reference):
    """A ``run_distributed`` body (here, so that the workers do not import transformers): the checkpoint at
    TP ``tp`` x PP ``world_size / tp`` generates ``reference``'s greedy tokens, static and dynamic decoding alike,
    with cached log-probs equal to one uncached forward's."""
    pstate = ParallelState.build(tensor_model_parallel_size=tp, pipeline_model_parallel_size=world_size // tp)
    model = load_gpt_for_inference(ckpt, pstate).model
    attention = model.decoder.layers[0].self_attention
    assert attention.groups_per_rank == 2 // tp  # tensor parallelism splits the query groups
    tok_ids = reference["prompts"]
    greedy = SamplingParams(max_new_tokens=reference["new"], greedy=True, stop_on_eod=False, logprobs=True)
    for static in (True, False):
        engine = InferenceEngine(model, pstate, eod=1, static_decode=static)
        outs = engine.generate(tok_ids, greedy)
        assert [o.generated for o in outs] == reference["generated"]
        # every cached log-prob (prompt pass and decoding steps) against one uncached forward over the sequences
        n = min(len(o.tokens) for o in outs)
        tokens = torch.tensor([o.tokens[:n] for o in outs])
        logits = engine.forward_logits(tokens)
        if logits is not None:
            full = F.log_softmax(logits[:, :-1, :engine.vocab_size], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
            cached = torch.tensor([o.logprobs[:n - 1] for o in outs])
            torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)
