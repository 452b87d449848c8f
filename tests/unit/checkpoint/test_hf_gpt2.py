"""Hugging Face GPT-2 export/import: logits, greedy generation and a round trip through every format."""

import json
import os

import pytest
import torch

from megatron.core.checkpoint_formats import (CheckpointFormatError, load_hf_gpt2, merge_tp_pp,
                                              read_megatron_checkpoint, read_our_checkpoint, save_hf_gpt2,
                                              split_tp_pp, write_megatron_checkpoint, write_our_checkpoint)
from megatron.core.parallel_state import ParallelState
from tests.conftest import SHARED_DATA
from tests.unit.checkpoint.helpers import build_stage, random_full, single_logits, tiny_dims

transformers = pytest.importorskip("transformers")


def _hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model.float().eval()


def _args(dims):
    return {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size, "global_batch_size": 8,
            "num_attention_heads": dims.num_attention_heads, "tokenizer_type": "NullTokenizer"}


def test_round_trip_ours_tp2_pp2_hf_ours_megatron_ours(tmp_path):
    dims = tiny_dims(vocab=100, layers=4, divisible_by=8)
    full = random_full(dims)
    ours22 = str(tmp_path / "ours_tp2_pp2")
    write_our_checkpoint(ours22, split_tp_pp(full, dims, 2, 2), dims, _args(dims), iteration=7)
    loaded = read_our_checkpoint(ours22)
    assert sorted(loaded.model_state_per_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert loaded.args_dict["padded_vocab_size"] == 112 and loaded.iteration == 7
    merged = merge_tp_pp(loaded.model_state_per_rank)

    hf_dir = str(tmp_path / "hf")
    files = save_hf_gpt2(hf_dir, merged, dims)
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(files)
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    assert cfg["vocab_size"] == 100 and cfg["activation_function"] == "gelu" and cfg["tie_word_embeddings"]

    hf_full, hf_dims, _, notes = load_hf_gpt2(hf_dir, make_vocab_size_divisible_by=8)
    assert notes == [] and hf_dims.vocab_size == 100 and hf_dims.padded_vocab_size == 104
    ours11 = str(tmp_path / "ours_tp1")
    write_our_checkpoint(ours11, split_tp_pp(hf_full, hf_dims, 1, 1), hf_dims, _args(hf_dims))
    again = merge_tp_pp(read_our_checkpoint(ours11).model_state_per_rank)
    mg = str(tmp_path / "megatron")
    write_megatron_checkpoint(mg, split_tp_pp(again, hf_dims, 1, 1), hf_dims, _args(hf_dims))
    final = merge_tp_pp(read_megatron_checkpoint(mg).model_state_per_rank)
    assert list(final) == list(full)
    for name, t in full.items():
        assert torch.equal(final[name], t), name  # padding rows were zero from the start


@pytest.mark.parametrize("tied", [True, False])
def test_hf_logits_equal_ours(tmp_path, tied):
    dims = tiny_dims(vocab=100, layers=2, tied=tied)
    full = random_full(dims, seed=1)
    save_hf_gpt2(str(tmp_path), full, dims)
    hf = _hf(str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 100, (3, 16), generator=gen)
        ours = single_logits(full, dims, tokens)[..., :100]
        with torch.no_grad():
            theirs = hf(tokens).logits
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_token_for_token(tmp_path):
    dims = tiny_dims(vocab=100, layers=2)
    full = random_full(dims, seed=2)
    for name in full:  # larger weights than the 0.02 init: varied, peaked next-token choices
        if name.endswith("weight") and "layernorm" not in name:
            full[name] = full[name] * 8.0
    save_hf_gpt2(str(tmp_path), full, dims)
    hf = _hf(str(tmp_path))
    prompt = torch.randint(0, 100, (2, 4), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    model = build_stage(dims, ParallelState.single(), full)
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            nxt = model(ids, pos)[:, -1, :100].argmax(-1, keepdim=True)  # [b, 1]
            ids = torch.cat([ids, nxt], dim=1)
    assert torch.equal(theirs, ids)
    assert len(set(ids[0, 4:].tolist())) > 1


def test_import_pytorch_model_bin_and_layernorm_1p(tmp_path):
    dims = tiny_dims(vocab=100, layers=2)
    dims.apply_layernorm_1p = True  # our gammas are stored minus one
    full = random_full(dims, seed=3)
    save_hf_gpt2(str(tmp_path / "a"), full, dims)
    hf = _hf(str(tmp_path / "a"))
    ln = full["decoder.layers.0.input_layernorm.weight"]
    assert torch.equal(hf.transformer.h[0].ln_1.weight.detach(), ln + 1.0)
    os.makedirs(tmp_path / "b")  # the older layout: pytorch_model.bin (a pickle of tensors) and config.json
    torch.save(hf.state_dict(), tmp_path / "b" / "pytorch_model.bin")
    os.replace(tmp_path / "a" / "config.json", tmp_path / "b" / "config.json")
    back, back_dims, _, _ = load_hf_gpt2(str(tmp_path / "b"), make_vocab_size_divisible_by=8)
    assert torch.equal(back["decoder.layers.0.input_layernorm.weight"], ln + 1.0)
    assert torch.equal(back["decoder.layers.1.self_attention.linear_qkv.weight"],
                       full["decoder.layers.1.self_attention.linear_qkv.weight"])


def test_refuses_other_architectures_and_unknown_tensors(tmp_path):
    dims = tiny_dims(vocab=100, layers=1)
    save_hf_gpt2(str(tmp_path), random_full(dims), dims)
    cfg_path = tmp_path / "config.json"
    cfg = json.load(open(cfg_path))
    json.dump(dict(cfg, model_type="llama"), open(cfg_path, "w"))
    with pytest.raises(CheckpointFormatError, match="model_type 'llama'"):
        load_hf_gpt2(str(tmp_path))
    json.dump(dict(cfg, scale_attn_by_inverse_layer_idx=True), open(cfg_path, "w"))
    with pytest.raises(CheckpointFormatError, match="scale_attn_by_inverse_layer_idx"):
        load_hf_gpt2(str(tmp_path))
    dims.vocab_size = None
    with pytest.raises(CheckpointFormatError, match="--true-vocab-size"):
        save_hf_gpt2(str(tmp_path / "x"), random_full(tiny_dims(vocab=100, layers=1)), dims)


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_DATA, "gpt2")), reason="shared GPT-2 vocabulary absent")
def test_export_writes_a_loadable_gpt2_tokenizer(tmp_path):
    vocab = os.path.join(SHARED_DATA, "gpt2", "vocab.json")
    merges = os.path.join(SHARED_DATA, "gpt2", "merges.txt")
    dims = tiny_dims(vocab=50257, layers=1, divisible_by=128)
    full = random_full(dims)
    files = save_hf_gpt2(str(tmp_path), full, dims, eod=50256, vocab_file=vocab, merge_file=merges)
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= set(files)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert tok("hello world")["input_ids"] == [31373, 995] and tok.eos_token_id == 50256
    gen_cfg = json.load(open(tmp_path / "generation_config.json"))
    assert gen_cfg["eos_token_id"] == 50256
    hf = _hf(str(tmp_path))
    assert hf.config.vocab_size == 50257
