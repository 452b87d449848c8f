"""tools/checkpoint/convert.py --model-type BERT with Hugging Face ``transformers`` as the independent reference:
pre-LN ``MegatronBertForPreTraining`` and post-LN ``BertForPreTraining`` (built from configs, no hub) in and out."""

import json
import os

import pytest
import torch

from megatron.core.checkpoint_formats import BERT, merge_tp_pp, read_our_checkpoint, split_tp_pp, write_our_checkpoint
from megatron.core.tokenizer.tokenizers import BertWordPieceTokenizer
from tests.unit.checkpoint.bert_helpers import (SEQ, batch, bert_dims, our_outputs, random_bert_full,
                                                write_vocab)
from tests.unit.checkpoint.test_convert import _run

transformers = pytest.importorskip("transformers")

VOCAB = 18  # the entries of write_vocab's vocab.txt, as Hugging Face counts them


def _hf_model(post_ln: bool):
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=SEQ, type_vocab_size=2, hidden_act="gelu", hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12, attn_implementation="eager")
    torch.manual_seed(0)
    if post_ln:
        model = transformers.BertForPreTraining(transformers.BertConfig(**kw))
    else:
        model = transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(**kw))
    with torch.no_grad():  # LayerNorms and biases away from (1, 0): every mapped tensor matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("post_ln", [False, True], ids=["pre_ln_megatron_bert", "post_ln_bert"])
def test_hf_to_ours_tp2_and_back(tmp_path, capsys, post_ln):
    hf = _hf_model(post_ln)
    hf_dir, ours, back = str(tmp_path / "hf"), str(tmp_path / "ours"), str(tmp_path / "back")
    hf.save_pretrained(hf_dir)
    vocab_file = write_vocab(tmp_path / "hf" / "vocab.txt")
    rc, out, err = _run(capsys, "--model-type", "BERT", "--loader", "hf", "--saver", "ours", "--load-dir", hf_dir,
                        "--save-dir", ours, "--target-tensor-parallel-size", "2",
                        "--make-vocab-size-divisible-by", "8")
    assert rc == 0, err
    assert "loaded BERT from hf checkpoint" in out and "vocabulary 18 padded to 24" in out
    flag = "with --apply-residual-connection-post-layernorm" if post_ln else "with the default (pre-LN) order"
    assert f"note: {'post' if post_ln else 'pre'}-LN BERT: run pretrain_bert.py on it {flag}" in out
    loaded = read_our_checkpoint(ours)
    assert sorted(loaded.model_state_per_rank) == [(0, 0), (1, 0)]
    assert loaded.model_state_per_rank[(1, 0)][0]["output_layer.bias"].shape == (16,)  # 32 rows / 2
    args = loaded.args_dict
    assert args["apply_residual_connection_post_layernorm"] is post_ln and args["bert_binary_head"] is True
    assert args["tokenizer_type"] == "BertWordPieceLowerCase" and args["vocab_file"] == vocab_file
    full = merge_tp_pp(loaded.model_state_per_rank, BERT)

    # our model on the converted weights gives Hugging Face's encoder output, MLM and binary logits
    hidden, logits, binary = our_outputs(full, bert_dims(VOCAB), post_ln, VOCAB)
    ids, types, padding = batch(VOCAB)
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=padding, output_hidden_states=True)
    torch.testing.assert_close(hidden, ref.hidden_states[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref.prediction_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(binary, ref.seq_relationship_logits, rtol=1e-5, atol=1e-5)

    # and back: the same weights, loadable by the pre-training class and by AutoModelForMaskedLM
    rc, out, err = _run(capsys, "--model-type", "BERT", "--loader", "ours", "--saver", "hf", "--load-dir", ours,
                        "--save-dir", back)
    assert rc == 0, err
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json"} <= set(os.listdir(back))
    cls = transformers.BertForPreTraining if post_ln else transformers.MegatronBertForPreTraining
    again = cls.from_pretrained(back, local_files_only=True).eval()
    original = hf.state_dict()
    assert set(again.state_dict()) == set(original)
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(back, local_files_only=True).eval()
    with torch.no_grad():
        mlm_logits = mlm(input_ids=ids, token_type_ids=types, attention_mask=padding).logits
    torch.testing.assert_close(mlm_logits, ref.prediction_logits, rtol=1e-5, atol=1e-5)
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["layer_norm_eps"] == 1e-12 and config["vocab_size"] == VOCAB and config["hidden_act"] == "gelu"


@pytest.mark.parametrize("post_ln, binary, tied", [(True, True, True), (False, False, True), (False, True, False)],
                         ids=["post_ln", "pre_ln_no_binary", "pre_ln_untied"])
def test_ours_tp2_to_hf_and_back(tmp_path, capsys, post_ln, binary, tied):
    """Megatron's vocabulary (vocab.txt + [BOS] [EOS]) goes out whole: the tokenizer files have every row's token."""
    vocab_file = write_vocab(tmp_path / "vocab.txt")
    vocab = BertWordPieceTokenizer(vocab_file, lower_case=True).vocab_size
    assert vocab == VOCAB + 2
    dims = bert_dims(vocab)
    dims.tied_embeddings = tied
    full = random_bert_full(dims, post_ln, binary)
    assert ("output_layer.weight" in full) is not tied
    args = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "tokenizer_type": "BertWordPieceLowerCase",
            "vocab_file": vocab_file, "apply_residual_connection_post_layernorm": post_ln,
            "bert_binary_head": binary, "hidden_dropout": 0.1, "attention_dropout": 0.1,
            "untie_embeddings_and_output_weights": not tied}
    src, hf_dir, back = str(tmp_path / "src"), str(tmp_path / "hf"), str(tmp_path / "back")
    write_our_checkpoint(src, split_tp_pp(full, dims, 2, 1, BERT), dims, args, release=True)
    rc, out, err = _run(capsys, "--model-type", "BERT", "--loader", "ours", "--saver", "hf", "--load-dir", src,
                        "--save-dir", hf_dir)
    assert rc == 0, err
    kind = ("BertFor" if post_ln else "MegatronBertFor") + ("PreTraining" if binary else "MaskedLM")
    assert f"written as {kind}" in out
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["architectures"] == [kind] and config["vocab_size"] == vocab
    assert config["hidden_dropout_prob"] == 0.1 and config["type_vocab_size"] == (2 if binary else 1)
    assert config["tie_word_embeddings"] is tied

    # the Hugging Face model computes what ours computes
    hf = getattr(transformers, kind).from_pretrained(hf_dir, local_files_only=True).eval()
    hidden, logits, binary_logits = our_outputs(full, dims, post_ln, vocab)
    ids, types, padding = batch(vocab)
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types if binary else None, attention_mask=padding,
                 output_hidden_states=True)
    torch.testing.assert_close(hidden, ref.hidden_states[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref.prediction_logits if binary else ref.logits, rtol=1e-5, atol=1e-5)
    if binary:
        torch.testing.assert_close(binary_logits, ref.seq_relationship_logits, rtol=1e-5, atol=1e-5)

    # the tokenizer files load offline and tokenise as ours does, [BOS]/[EOS] included as the last two rows
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    assert len(tok) == vocab and tok.convert_tokens_to_ids(["[BOS]", "[EOS]"]) == [VOCAB, VOCAB + 1]
    ours_tok = BertWordPieceTokenizer(vocab_file, lower_case=True)
    text = "Hello world, the cats sat on the mat."
    assert tok(text, add_special_tokens=False)["input_ids"] == ours_tok.tokenize(text)

    # back to ours at TP=1: the same weights (the padding rows are zeros on both sides)
    rc, out, err = _run(capsys, "--model-type", "BERT", "--loader", "hf", "--saver", "ours", "--load-dir", hf_dir,
                        "--save-dir", back, "--make-vocab-size-divisible-by", "8")
    assert rc == 0, err
    loaded = read_our_checkpoint(back)
    assert loaded.args_dict["bert_binary_head"] is binary
    assert loaded.args_dict["apply_residual_connection_post_layernorm"] is post_ln
    assert loaded.args_dict["untie_embeddings_and_output_weights"] is not tied
    again = merge_tp_pp(loaded.model_state_per_rank, BERT, tied=tied)
    assert list(again) == list(full)
    for name, tensor in full.items():
        assert torch.equal(again[name], tensor), name


def test_refusals_name_the_setting(tmp_path, capsys):
    hf = _hf_model(post_ln=True)
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(str(hf_dir))
    capsys.readouterr()  # transformers' progress bars
    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value, message in (("position_embedding_type", "relative_key", "position_embedding_type"),
                                ("hidden_act", "relu", "hidden_act 'relu'"), ("model_type", "roberta", "roberta")):
        cfg_path.write_text(json.dumps(dict(cfg, **{key: value})))
        rc, _, err = _run(capsys, "--model-type", "BERT", "--loader", "hf", "--saver", "ours", "--load-dir",
                          str(hf_dir), "--save-dir", str(tmp_path / "out"))
        assert rc == 2 and message in err and err.count("\n") == 1
    # a GPT-2 checkpoint read as BERT is refused by its first foreign parameter
    rc, _, err = _run(capsys, "--model-type", "BERT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                      os.path.join(os.path.dirname(__file__), "fixtures", "megatron_gpt"), "--save-dir",
                      str(tmp_path / "o"))
    assert rc == 2 and "--model-type BERT" in err and "decoder.layers.0" in err


def test_megatron_core_bert_through_megatron_tp2_pp2_to_hf_gives_its_outputs(tmp_path, capsys):
    """Megatron-Core 0.16.1's own BertModel outputs (tests/unit/models/golden/) for weights drawn by
    ``golden_weight``: a Megatron-LM checkpoint of those weights, resharded to TP=2 x PP=2 and exported, makes
    ``MegatronBertForPreTraining`` compute them."""
    import argparse

    from tests.unit.models.golden.make_megatron_core_bert_golden import golden_weight

    gold = json.load(open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "golden",
                                       "megatron_core_bert.json")))
    c = gold["config"]
    model = {}
    for name, shape in gold["state_dict_shapes"].items():  # Megatron-Core's order
        model[name] = golden_weight(name, shape)
        module = name.rsplit(".", 1)[0]
        if name.endswith(".bias") and module.endswith(("linear_proj", "linear_qkv", "linear_fc1", "linear_fc2",
                                                       "output_layer")):
            model[module + "._extra_state"] = None
    args = argparse.Namespace(num_layers=c["num_layers"], hidden_size=c["hidden_size"],
                              num_attention_heads=c["num_attention_heads"], ffn_hidden_size=4 * c["hidden_size"],
                              max_position_embeddings=c["seq_length"], seq_length=c["seq_length"],
                              padded_vocab_size=c["vocab_size"], layernorm_epsilon=c["layernorm_epsilon"],
                              bert_binary_head=True, tokenizer_type="BertWordPieceLowerCase",
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              consumed_train_samples=0)
    src = tmp_path / "megatron"
    (src / "release" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": model},
               src / "release" / "mp_rank_00" / "model_optim_rng.pt")
    (src / "latest_checkpointed_iteration.txt").write_text("release")
    mid, hf_dir = str(tmp_path / "mid"), str(tmp_path / "hf")
    rc, _, err = _run(capsys, "--model-type", "BERT", "--loader", "megatron", "--saver", "megatron", "--load-dir",
                      str(src), "--save-dir", mid, "--target-tensor-parallel-size", "2",
                      "--target-pipeline-parallel-size", "2", "--true-vocab-size", str(c["vocab_size"]),
                      "--make-vocab-size-divisible-by", "8")
    assert rc == 0, err
    rc, out, err = _run(capsys, "--model-type", "BERT", "--loader", "megatron", "--saver", "hf", "--load-dir", mid,
                        "--save-dir", hf_dir, "--true-vocab-size", str(c["vocab_size"]))
    assert rc == 0, err
    assert "pre-LN BERT written as MegatronBertForPreTraining" in out
    hf = transformers.MegatronBertForPreTraining.from_pretrained(hf_dir, local_files_only=True).eval()
    ids, types, padding = (torch.tensor(gold[k]) for k in ("input_ids", "tokentype_ids", "padding_mask"))
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=padding)
    real = padding.bool()  # Megatron-Core also masks padded queries: only real tokens are comparable
    torch.testing.assert_close(ref.prediction_logits[real], torch.tensor(gold["logits_at_real_tokens"]), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(ref.seq_relationship_logits, torch.tensor(gold["binary_logits"]), rtol=1e-5,
                               atol=1e-5)
