"""tools/checkpoint/convert.py --model-type BERT between ours and Megatron-LM's legacy format, resharding TP/PP, with
the optimizer state of a real training run; Megatron-Core's own BertModel names and order are the reference."""

import json
import os
import sys

import pytest
import torch

from megatron.core.checkpoint_formats import (BERT, load_megatron_file, merge_tp_pp, read_megatron_checkpoint,
                                              read_our_checkpoint, split_tp_pp, write_megatron_checkpoint,
                                              write_our_checkpoint)
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.partition import layers_for_stage
from tests.unit.checkpoint.bert_helpers import batch, bert_dims, bert_model, random_bert_full, write_vocab
from tests.unit.checkpoint.test_convert import ROOT, _run

GOLDEN = os.path.join(ROOT, "tests", "unit", "models", "golden", "megatron_core_bert.json")


def _args(vocab_file, post_ln=False, binary=True):
    return {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "tokenizer_type": "BertWordPieceLowerCase",
            "vocab_file": vocab_file, "apply_residual_connection_post_layernorm": post_ln, "bert_binary_head": binary}


def test_megatron_output_has_megatron_core_names_and_order(tmp_path):
    """Megatron-Core 0.16.1's BertModel state dict (2 layers, tied, binary head) lists exactly these tensors in this
    order; the optimizer's parameter order follows the same module order."""
    golden = json.load(open(GOLDEN))["state_dict_shapes"]
    dims = bert_dims(64)
    full = random_bert_full(dims, post_ln=False)
    write_megatron_checkpoint(str(tmp_path), {(0, 0): [full]}, dims, _args(None), family=BERT, release=True)
    model = load_megatron_file(os.path.join(str(tmp_path), "release", "mp_rank_00", "model_optim_rng.pt"))["model"]
    assert [k for k, v in model.items() if torch.is_tensor(v)] == list(golden)
    extra = [k for k, v in model.items() if v is None]
    assert extra == [f"encoder.layers.{i}.{m}._extra_state" for i in range(2) for m in
                     ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                      "mlp.linear_fc2")] + ["output_layer._extra_state"]


def _stage_logits(ranks, dims, pp, post_ln):
    """MLM logits of a TP=1 x PP=pp layout, each stage a separate model loaded strictly, run one after another."""
    ids, types, padding = batch(dims.vocab_size)
    hidden = None
    for p in range(pp):
        offset, count = layers_for_stage(dims.num_layers, pp, p)
        pstate = ParallelState(pp_size=pp, pp_rank=p, pp_ranks=list(range(pp)))
        stage = bert_model(dims, post_ln, pstate=pstate, pre_process=p == 0, post_process=p == pp - 1,
                           num_layers=count, layer_offset=offset)
        stage.load_state_dict(ranks[(0, p)][0], strict=True)
        stage.set_input_tensor(hidden)
        with torch.no_grad():
            hidden = stage(ids, padding, tokentype_ids=types)
    return hidden[0]


@pytest.mark.parametrize("post_ln, binary", [(True, True), (False, False)], ids=["post_ln", "pre_ln_no_binary"])
def test_ours_megatron_tp2_pp2_round_trip(tmp_path, capsys, post_ln, binary):
    vocab_file = write_vocab(tmp_path / "vocab.txt")
    dims = bert_dims(20)  # 18 entries + [BOS] [EOS]
    full = random_bert_full(dims, post_ln, binary)
    src, mg, back = str(tmp_path / "src"), str(tmp_path / "mg"), str(tmp_path / "back")
    write_our_checkpoint(src, split_tp_pp(full, dims, 1, 1, BERT), dims, _args(vocab_file, post_ln, binary),
                         release=True)
    rc, out, err = _run(capsys, "--model-type", "BERT", "--loader", "ours", "--saver", "megatron", "--load-dir", src,
                        "--save-dir", mg, "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size",
                        "2")
    assert rc == 0, err
    assert "loaded BERT from ours checkpoint" in out and "vocabulary 20 padded to 24" in out
    assert "as megatron checkpoint TP=2 PP=2 (vocabulary padded to 32)" in out
    loaded = read_megatron_checkpoint(mg, BERT)
    first, last = loaded.model_state_per_rank[(1, 0)][0], loaded.model_state_per_rank[(1, 1)][0]
    assert ("embedding.tokentype_embeddings.weight" in first) is binary and "output_layer.bias" not in first
    assert last["output_layer.bias"].shape == (16,) and last["output_layer.weight"].shape == (16, 32)  # tied copy
    assert ("binary_head.weight" in last) is binary
    raw = load_megatron_file(os.path.join(mg, "release", "mp_rank_01_001", "model_optim_rng.pt"))
    assert raw["args"].apply_residual_connection_post_layernorm is post_ln and raw["args"].bert_binary_head is binary
    assert "output_layer._extra_state" in raw["model"]

    # megatron TP=2 x PP=2 -> ours TP=1 x PP=2: every stage loads strictly and the logits are the unsharded model's
    rc, _, err = _run(capsys, "--model-type", "BERT", "--loader", "megatron", "--saver", "ours", "--load-dir", mg,
                      "--save-dir", back, "--target-tensor-parallel-size", "1")
    assert rc == 0, err
    staged = read_our_checkpoint(back)
    assert sorted(staged.model_state_per_rank) == [(0, 0), (0, 1)]
    ids, types, padding = batch(20)
    whole = bert_model(dims, post_ln, binary)
    whole.load_state_dict(full, strict=True)
    with torch.no_grad():
        ref = whole(ids, padding, tokentype_ids=types if binary else None)[0]
    if binary:
        torch.testing.assert_close(_stage_logits(staged.model_state_per_rank, dims, 2, post_ln), ref, rtol=0, atol=0)
    again = merge_tp_pp(staged.model_state_per_rank, BERT)
    assert list(again) == list(full)
    for name, tensor in full.items():
        rows = tensor.shape[0] if name in BERT.vocab_params else None
        assert torch.equal(again[name][:rows], tensor), name


def _train(vocab: str, iters: int, **extra):
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import pretrain_bert
    from tests.unit.models.test_bert_pretrain import _argv, in_memory_datasets

    argv = _argv(vocab, iters, **{"apply-residual-connection-post-layernorm": True, **extra})
    return pretrain_bert.main(argv, datasets=in_memory_datasets)


@pytest.fixture(scope="module")
def vocab_64(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("bert_vocab") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]) + "\n")
    return str(vocab)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, vocab_64):
    """A checkpoint of pretrain_bert.py (post-LN) after 2 iterations (fp32, Adam moments, scheduler)."""
    ckpt = str(tmp_path_factory.mktemp("bert_trained") / "ckpt")
    _train(vocab_64, 2, save=ckpt)
    return ckpt


def test_trainer_checkpoint_through_megatron_tp2_pp2_keeps_model_and_optimizer(trained, vocab_64, tmp_path, capsys):
    mg, back = str(tmp_path / "mg"), str(tmp_path / "back")
    rc, out, err = _run(capsys, "--model-type", "BERT", "--loader", "ours", "--saver", "megatron", "--load-dir",
                        trained, "--save-dir", mg, "--target-tensor-parallel-size", "2",
                        "--target-pipeline-parallel-size", "2", "--reshard-optimizer")
    assert rc == 0, err
    assert "saved model, optimizer and scheduler as megatron checkpoint TP=2 PP=2" in out
    last = load_megatron_file(os.path.join(mg, "iter_0000002", "mp_rank_00_001", "model_optim_rng.pt"))
    # Megatron-Core's order on the last stage: layer 1, final norm, lm_head, output layer (weight, bias), binary head,
    # pooler; the decayed group holds the matrices, the other the biases and norm parameters
    tensors = [k for k, v in last["model"].items() if torch.is_tensor(v)]
    assert tensors[-6:] == ["output_layer.weight", "output_layer.bias", "binary_head.weight", "binary_head.bias",
                            "pooler.dense.weight", "pooler.dense.bias"]
    groups = [len(g["params"]) for g in last["optimizer"]["param_groups"]]
    assert groups == [4 + 1 + 1 + 1 + 1, 8 + 2 + 3 + 1 + 1 + 1]
    assert last["opt_param_scheduler"]["num_steps"] == 2 * 8  # samples

    rc, _, err = _run(capsys, "--model-type", "BERT", "--loader", "megatron", "--saver", "ours", "--load-dir", mg,
                      "--save-dir", back, "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size",
                      "1", "--reshard-optimizer")
    assert rc == 0, err
    original = torch.load(os.path.join(trained, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"),
                          weights_only=True)
    new = torch.load(os.path.join(back, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"), weights_only=True)
    assert list(new["model"]) == list(original["model"])
    for k, v in original["model"].items():
        assert torch.equal(new["model"][k], v), k
    old_opt, new_opt = original["optimizer"], new["optimizer"]
    old_state = old_opt.get("optimizer", old_opt)["state"]
    new_state = new_opt.get("optimizer", new_opt)["state"]
    assert sorted(old_state) == sorted(new_state) and len(old_state) == len(original["model"])
    for pid, st in old_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new_state[pid][key], st[key]), (pid, key)
    assert new["opt_param_scheduler"] == original["opt_param_scheduler"]
    assert new["iteration"] == 2 and new["consumed_train_samples"] == 16
    assert new["args"]["apply_residual_connection_post_layernorm"] is True

    # the trainer resumes the converted checkpoint (its RNG state stayed behind with the source layout) and its
    # third iteration is the one resumed from the trainer's own checkpoint
    common = {"no-load-rng": True, "attention-backend": "unfused"}
    resumed = _train(vocab_64, 3, load=back, **common)
    reference = _train(vocab_64, 3, load=trained, **common)
    capsys.readouterr()
    assert [row["iteration"] for row in resumed["history"]] == [3] and resumed["history"][0]["lm loss"] > 0
    assert resumed["history"] == reference["history"]
