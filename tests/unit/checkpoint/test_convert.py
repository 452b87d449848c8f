"""tools/checkpoint/convert.py end to end on the Megatron-Core fixture."""

import dataclasses
import importlib.util
import os

import pytest
import torch

from megatron.core.checkpoint_formats import load_megatron_file, read_megatron_checkpoint, read_our_checkpoint
from tests.unit.checkpoint.helpers import FIXTURE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RAW = os.path.join(FIXTURE, "iter_0000003", "mp_rank_00", "model_optim_rng.pt")


def _convert_module():
    spec = importlib.util.spec_from_file_location("convert_tool", os.path.join(ROOT, "tools", "checkpoint",
                                                                              "convert.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(capsys, *argv):
    rc = _convert_module().main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_megatron_to_ours_tp2_pp2_and_back_keeps_model_and_optimizer(tmp_path, capsys):
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    rc, out, _ = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                      FIXTURE, "--save-dir", ours, "--target-tensor-parallel-size", "2",
                      "--target-pipeline-parallel-size", "2", "--reshard-optimizer")
    assert rc == 0
    assert "loaded GPT from megatron checkpoint" in out and "55,680 parameters" in out
    assert "saved model, optimizer and scheduler as ours checkpoint TP=2 PP=2 (vocabulary padded to 128)" in out
    assert "RNG state dropped" in out
    loaded = read_our_checkpoint(ours)
    assert sorted(loaded.model_state_per_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert loaded.iteration == 3 and loaded.consumed_samples == 6 and loaded.scheduler["num_steps"] == 3
    last = loaded.model_state_per_rank[(1, 1)][0]
    assert last["output_layer.weight"].shape == (64, 64)  # the tied copy: 128 padded rows / 2
    # first stage: 2 embeddings + 12 of layer 0; last stage: 12 of layer 1 + final norm (2) + tied output weight
    assert len(loaded.optimizer[(0, 0)]["fp32_from_fp16_params"]) == 14
    last_mains = loaded.optimizer[(0, 1)]["fp32_from_fp16_params"]
    assert len(last_mains) == 15
    first_mains = loaded.optimizer[(0, 0)]["fp32_from_fp16_params"]
    # decayed group of the last stage: layer 1's four matrices, then the output weight (the word embeddings' copy)
    assert last_mains[4].shape == (64, 64) and torch.equal(last_mains[4], first_mains[0])
    rc, out, _ = _run(capsys, "--model-type", "GPT", "--loader", "ours", "--saver", "megatron", "--load-dir", ours,
                      "--save-dir", back, "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size",
                      "1", "--reshard-optimizer")
    assert rc == 0 and "as megatron checkpoint TP=1 PP=1" in out
    raw = load_megatron_file(RAW)
    new = load_megatron_file(os.path.join(back, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    assert list(new["model"]) == list(raw["model"])
    for k, v in raw["model"].items():
        assert (new["model"][k] is None) if v is None else torch.equal(new["model"][k], v), k
    for a, b in zip(new["optimizer"]["fp32_from_fp16_params"], raw["optimizer"]["fp32_from_fp16_params"]):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    for pid, st in raw["optimizer"]["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new["optimizer"]["optimizer"]["state"][pid][key], st[key])
    assert new["opt_param_scheduler"] == raw["opt_param_scheduler"]
    assert new["args"].consumed_train_samples == 6


def test_megatron_reshard_tp2_pp2_and_back_is_exact(tmp_path, capsys):
    mid, back = str(tmp_path / "mid"), str(tmp_path / "back")
    base = ["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--reshard-optimizer"]
    rc, out, _ = _run(capsys, *base, "--load-dir", FIXTURE, "--save-dir", mid, "--target-tensor-parallel-size", "2",
                      "--target-pipeline-parallel-size", "2")
    assert rc == 0 and sorted(os.listdir(os.path.join(mid, "iter_0000003"))) == [
        "manifest.json", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    last = load_megatron_file(os.path.join(mid, "iter_0000003", "mp_rank_01_001", "model_optim_rng.pt"))
    assert "output_layer._extra_state" in last["model"] and "decoder.layers.0.mlp.linear_fc2.weight" in last["model"]
    assert last["args"].tensor_model_parallel_size == 2 and last["args"].padded_vocab_size == 128
    assert [len(g) for g in last["optimizer"]["fp32_from_fp16_params"]] == [5, 10]
    rc, _, _ = _run(capsys, *base, "--load-dir", mid, "--save-dir", back, "--target-tensor-parallel-size", "1",
                    "--target-pipeline-parallel-size", "1")
    assert rc == 0
    raw = load_megatron_file(RAW)
    new = load_megatron_file(os.path.join(back, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    for k, v in raw["model"].items():
        assert (new["model"][k] is None) if v is None else torch.equal(new["model"][k], v), k
    for pid, st in raw["optimizer"]["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new["optimizer"]["optimizer"]["state"][pid][key], st[key])
    assert new["opt_param_scheduler"] == raw["opt_param_scheduler"]


@pytest.mark.parametrize("fixture", ["megatron_gpt", "megatron_gpt_tp2", "megatron_gpt_dist"])
def test_megatron_to_hf_gives_megatron_core_logits(tmp_path, capsys, fixture):
    transformers = pytest.importorskip("transformers")
    root = os.path.join(os.path.dirname(FIXTURE), fixture)
    hf_dir = str(tmp_path / "hf")
    rc, out, _ = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", root,
                      "--save-dir", hf_dir)
    assert rc == 0 and "saved Hugging Face model" in out and "model.safetensors" in out
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).float().eval()
    golden_root = FIXTURE if fixture == "megatron_gpt_dist" else root  # torch_dist: the same run's weights
    golden = torch.load(os.path.join(golden_root, "golden.pt"), weights_only=True)
    with torch.no_grad():
        logits = hf(golden["tokens"]).logits
    torch.testing.assert_close(logits, golden["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["--saver", "hf", "--target-tensor-parallel-size", "2"], "--target-tensor-parallel-size 2"),
    (["--saver", "hf", "--reshard-optimizer"], "--reshard-optimizer"),
    (["--saver", "ours", "--target-pipeline-parallel-size", "3"], "--target-pipeline-parallel-size 3"),
    (["--saver", "ours", "--target-tensor-parallel-size", "3"], "--target-tensor-parallel-size 3"),
])
def test_refusals_name_the_option(tmp_path, capsys, extra, message):
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--load-dir", FIXTURE, "--save-dir",
                      str(tmp_path / "out"), *extra)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_torch_dist_optimizer_state_converts_by_name_and_its_absence_is_named(tmp_path, capsys):
    """Megatron-LM's torch_dist run with the distributed optimizer (fixtures/make_megatron_torch_dist_optim_fixture.py)
    converts with its optimizer to ours at TP=2 and back to one rank, every main copy and moment unchanged; a
    torch_dist folder written without an optimizer says so."""
    root = os.path.join(os.path.dirname(FIXTURE), "megatron_gpt_torch_dist")
    ours = str(tmp_path / "ours")
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir", root,
                      "--save-dir", ours, "--target-tensor-parallel-size", "2", "--reshard-optimizer")
    assert rc == 0, err
    want, _ = read_megatron_checkpoint(root).extra["optimizer_by_name"][(0, 0)]
    back = str(tmp_path / "back")
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "ours", "--saver", "ours", "--load-dir", ours,
                      "--save-dir", back, "--target-tensor-parallel-size", "1", "--reshard-optimizer")
    assert rc == 0, err
    got = read_our_checkpoint(back).extra["optimizer_by_name"][(0, 0)][0]
    for name, entry in want[0].items():
        for key, value in entry.items():
            torch.testing.assert_close(got[0][name][key], value, atol=0, rtol=0, msg=f"{name} {key}")
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                      os.path.join(os.path.dirname(FIXTURE), "megatron_gpt_dist"), "--save-dir",
                      str(tmp_path / "o"), "--reshard-optimizer")
    assert rc == 2 and "--reshard-optimizer" in err and "holds no optimizer state" in err


def test_refuses_unknown_model_type_and_flags(tmp_path, capsys):
    rc, _, err = _run(capsys, "--model-type", "BERT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                      FIXTURE, "--save-dir", str(tmp_path / "o"))
    assert rc == 2 and "--model-type BERT" in err
    with pytest.raises(SystemExit):
        _convert_module().main(["--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                                FIXTURE, "--save-dir", str(tmp_path / "o"), "--target-expert-parallel-size", "2"])
    assert "--target-expert-parallel-size" in capsys.readouterr().err


@pytest.mark.parametrize("typed", [True, False])
def test_our_checkpoint_args_of_either_trainer_version_give_the_model_sizes(tmp_path, typed):
    """The trainer's typed configuration stores ``norm_epsilon`` and no padded vocabulary; older checkpoints of
    this project store ``layernorm_epsilon`` and ``padded_vocab_size``. Both read as the same sizes."""
    from megatron.core.checkpoint_formats import dims_from_args, split_tp_pp, write_our_checkpoint
    from tests.unit.checkpoint.helpers import random_full, tiny_dims

    dims = tiny_dims(vocab=100, divisible_by=8)
    dims = dataclasses.replace(dims, padded_vocab_size=112, layernorm_epsilon=1e-3)  # 2 shards of 56 rows
    write_our_checkpoint(str(tmp_path), split_tp_pp(random_full(dims), dims, 2, 1), dims, {}, iteration=3)
    for rank in ("mp_rank_00", "mp_rank_01"):
        file = tmp_path / "iter_0000003" / rank / "model_optim_rng.pt"
        state = torch.load(file, weights_only=True)
        if typed:  # rewrite the stored arguments as the typed configuration's plain dict holds them
            args = state["args"]
            args["norm_epsilon"] = args.pop("layernorm_epsilon")
            del args["padded_vocab_size"]
        torch.save(state, file)
    loaded = read_our_checkpoint(str(tmp_path))
    got = dims_from_args(loaded.args_dict, vocab_size=100)
    assert (got.padded_vocab_size, got.layernorm_epsilon, got.padded_for(2)) == (112, 1e-3, 112)
    assert loaded.args_dict["tensor_model_parallel_size"] == 2
