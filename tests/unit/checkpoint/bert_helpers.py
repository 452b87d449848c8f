"""Tiny BERTs for the checkpoint tests: our model from checkpoint sizes, a WordPiece vocabulary, random weights."""

from __future__ import annotations

import dataclasses

import torch

from megatron.core.checkpoint_formats import ModelDims, pad_vocab_size
from megatron.core.models.bert import BertModel, initialize_bert_parameters
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "##s", "##ing", "run", "hello", "world", "."]
SEQ = 16


def write_vocab(path) -> str:
    """A WordPiece vocab.txt of 18 entries (our tokenizer appends [BOS] and [EOS]: 20 ids)."""
    path.write_text("".join(t + "\n" for t in SPECIAL + WORDS))
    return str(path)


def bert_dims(vocab: int, layers: int = 2, divisible_by: int = 8, eps: float = 1e-12) -> ModelDims:
    return ModelDims(num_layers=layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     max_position_embeddings=SEQ, padded_vocab_size=pad_vocab_size(vocab, divisible_by, 1),
                     vocab_size=vocab, make_vocab_size_divisible_by=divisible_by, seq_length=SEQ,
                     layernorm_epsilon=eps)


def bert_model(dims: ModelDims, post_ln: bool, binary: bool = True, pstate: ParallelState = None,
               pre_process: bool = True, post_process: bool = True, num_layers=None, layer_offset: int = 0):
    pstate = pstate or ParallelState.single()
    config = TransformerConfig(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_attention_heads,
        ffn_hidden_size=dims.ffn_hidden_size, seq_length=SEQ, max_position_embeddings=dims.max_position_embeddings,
        padded_vocab_size=dims.padded_for(pstate.tp_size), attention_dropout=0.0, hidden_dropout=0.0,
        layernorm_epsilon=dims.layernorm_epsilon, attention_mask_type="padding", attention_backend="unfused",
        apply_residual_connection_post_layernorm=post_ln, use_fused_kernels=False,
        gradient_accumulation_fusion=False, share_embeddings_and_output_weights=dims.tied_embeddings)
    return BertModel(config, pstate, pre_process=pre_process, post_process=post_process, num_layers=num_layers,
                     layer_offset=layer_offset, num_tokentypes=2 if binary else 0, add_binary_head=binary).eval()


def random_bert_full(dims: ModelDims, post_ln: bool, binary: bool = True, seed: int = 0) -> dict:
    """Our full state dict, initialised as the trainer does, with non-trivial norms and biases and zero
    vocabulary-padding rows."""
    model = bert_model(dims, post_ln, binary)
    initialize_bert_parameters(model, seed, model.config, ParallelState.single())
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in full.items():
        if "norm" in name or name.endswith(".bias"):
            full[name] = t + 0.1 * torch.randn(t.shape, generator=g)
    for name in ("embedding.word_embeddings.weight", "output_layer.bias", "output_layer.weight"):
        if name in full:
            full[name][dims.vocab_size:] = 0.0
    return full


def batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, SEQ), generator=g)
    types = torch.zeros(3, SEQ, dtype=torch.long)
    types[:, 7:] = 1
    lengths = torch.tensor([SEQ, 11, 6])
    padding = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [b, s], 1 = token
    return ids, types, padding


def our_outputs(full: dict, dims: ModelDims, post_ln: bool, vocab: int):
    """``(encoder output [b, s, h], MLM logits over the real vocabulary, binary logits)`` of the whole model."""
    binary = "binary_head.weight" in full
    rows = full["embedding.word_embeddings.weight"].shape[0]
    model = bert_model(dataclasses.replace(dims, padded_vocab_size=rows, vocab_size=None,
                                           tied_embeddings="output_layer.weight" not in full), post_ln, binary)
    model.load_state_dict(full, strict=True)
    ids, types, padding = batch(vocab)
    captured = {}
    model.encoder.register_forward_hook(lambda m, i, o: captured.update(hidden=o))  # returns None: no change
    with torch.no_grad():
        logits, binary_logits = model(ids, padding, tokentype_ids=types if binary else None)
    return captured["hidden"].transpose(0, 1), logits[..., :vocab], binary_logits
