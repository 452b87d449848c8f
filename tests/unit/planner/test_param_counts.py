"""Whole-model parameter counts of the planner against Hugging Face ``transformers`` models of the same shape
(GPT-2: tied embeddings, learned positions, biases everywhere; BERT: token types, LM-head transform, pooler and
binary head; the one embedding-LayerNorm of post-LN BERT takes the place of the pre-LN final LayerNorm)."""

import pytest

from megatron.core.planner import Layout, ModelShape
from megatron.core.planner.memory import param_count

transformers = pytest.importorskip("transformers")


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("layers,h,heads,ffn,vocab,pos", [(2, 64, 4, 256, 301, 32), (3, 96, 3, 200, 1000, 48)])
def test_gpt_count_matches_gpt2(layers, h, heads, ffn, vocab, pos):
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=h, n_head=heads, n_inner=ffn, vocab_size=vocab,
                                  n_positions=pos)
    ref = _count(transformers.GPT2LMHeadModel(cfg))  # tied output weight counted once
    shape = ModelShape(num_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn,
                       seq_length=pos, vocab_size=vocab, make_vocab_size_divisible_by=1)
    assert param_count(shape, Layout(), 0) == ref
    # TP 2 halves the sharded matrices only: the sum over TP ranks of a stage counts the replicated vectors twice
    assert param_count(shape, Layout(tp=2), 0) < ref


def test_bert_count_matches_bert_for_pretraining():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                  vocab_size=301, max_position_embeddings=32, type_vocab_size=2)
    ref = _count(transformers.BertForPreTraining(cfg))
    shape = ModelShape(model="bert", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                       seq_length=32, vocab_size=301, make_vocab_size_divisible_by=1)
    assert param_count(shape, Layout(), 0) == ref


def test_published_sizes():
    bert_large = ModelShape(model="bert", num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=512,
                            vocab_size=30522)
    assert round(param_count(bert_large, Layout(), 0) / 1e6) == 336  # Megatron-LM's BERT-large


def test_bert_without_binary_head_matches_masked_lm():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                  vocab_size=301, max_position_embeddings=32, type_vocab_size=1)
    model = transformers.BertForMaskedLM(cfg)
    ref = _count(model) - _count(model.bert.embeddings.token_type_embeddings)  # Megatron drops the token types
    shape = ModelShape(model="bert", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                       seq_length=32, vocab_size=301, make_vocab_size_divisible_by=1, bert_binary_head=False,
                       num_tokentypes=0)
    assert param_count(shape, Layout(), 0) == ref
