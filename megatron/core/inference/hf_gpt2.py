"""Our GPT's weights in a Hugging Face ``GPT2LMHeadModel``, the independent reference that the inference tests and
``bench/generation.py`` compare against (``transformers`` is imported only when this is called)."""

from __future__ import annotations

import torch


def to_hf_gpt2(model, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    """A ``transformers.GPT2LMHeadModel`` holding the weights of ``model`` (a whole GPT at TP=1), on the same
    device, in ``dtype``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.config
    h, n = cfg.hidden_size, cfg.num_attention_heads
    d = h // n
    hf_cfg = GPT2Config(
        vocab_size=cfg.padded_vocab_size, n_positions=cfg.max_position_embeddings, n_embd=h,
        n_layer=cfg.num_layers, n_head=n, n_inner=cfg.ffn_hidden_size,
        activation_function="gelu",  # the erf GeLU our MLP uses ("gelu_new" would be the tanh one)
        layer_norm_epsilon=cfg.layernorm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=cfg.share_embeddings_and_output_weights, bos_token_id=None, eos_token_id=None,
    )
    with torch.device("meta"):  # no random initialisation: every weight is assigned below
        hf = GPT2LMHeadModel(hf_cfg)
    hf.config._attn_implementation = attn_implementation
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    out = {"transformer.wte.weight": sd["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": sd["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": sd["decoder.final_layernorm.bias"]}
    out["lm_head.weight"] = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    for i in range(cfg.num_layers):
        ours, theirs = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv_w = sd[ours + "self_attention.linear_qkv.weight"]  # [3h, h], rows per head [q k v]
        qkv_b = sd[ours + "self_attention.linear_qkv.bias"]  # [3h]
        # HF's fused c_attn has columns [all q | all k | all v]; Conv1D weights are [in, out]
        qkv_w = qkv_w.view(n, 3, d, h).transpose(0, 1).reshape(3 * h, h)  # rows [q heads | k heads | v heads]
        qkv_b = qkv_b.view(n, 3, d).transpose(0, 1).reshape(3 * h)
        out[theirs + "attn.c_attn.weight"] = qkv_w.t()
        out[theirs + "attn.c_attn.bias"] = qkv_b
        out[theirs + "attn.c_proj.weight"] = sd[ours + "self_attention.linear_proj.weight"].t()
        out[theirs + "attn.c_proj.bias"] = sd[ours + "self_attention.linear_proj.bias"]
        out[theirs + "mlp.c_fc.weight"] = sd[ours + "mlp.linear_fc1.weight"].t()
        out[theirs + "mlp.c_fc.bias"] = sd[ours + "mlp.linear_fc1.bias"]
        out[theirs + "mlp.c_proj.weight"] = sd[ours + "mlp.linear_fc2.weight"].t()
        out[theirs + "mlp.c_proj.bias"] = sd[ours + "mlp.linear_fc2.bias"]
        for a, b in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[theirs + b + ".weight"] = sd[ours + a + ".weight"]
            out[theirs + b + ".bias"] = sd[ours + a + ".bias"]
    if hf_cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    out = {k: v.contiguous() for k, v in out.items()}
    missing, unexpected = hf.load_state_dict(out, strict=False, assign=True)
    if missing or unexpected:
        raise KeyError(f"GPT-2 mapping incomplete: missing {missing}, unexpected {unexpected}")
    if hf_cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()
