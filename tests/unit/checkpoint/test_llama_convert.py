"""Llama-family checkpoints through ``tools/checkpoint/convert.py`` and the trainer.

References: Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (random small models, fp32 logits to 1e-5),
and checkpoints Megatron-Core's own ``GPTModel`` wrote at TP 2 with its logits, Llama-shaped and a Qwen2-style
twin (``fixtures/make_megatron_core_llama_fixture.py``; its ``load`` step recorded Megatron-Core loading what our
converter writes, ``megatron_core_loads_ours.json``).
"""

import dataclasses
import json
import os

import pytest
import torch

from megatron.core.checkpoint_formats import (GPT, CheckpointFormatError, dims_from_args, load_megatron_file,
                                              merge_tp_pp, read_megatron_checkpoint, read_our_checkpoint,
                                              spec_from_saved)
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig
from tests.functional.harness import run_pretrain
from tests.unit.checkpoint.test_convert import _run

transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
MCORE = os.path.join(HERE, "fixtures", "megatron_llama_tp2")
MCORE_DIST = os.path.join(HERE, "fixtures", "megatron_llama_tp2_dist")  # the same weights, Megatron-Core's torch_dist
# the Qwen2-style twin: QKV biases only, RoPE theta 1e6 without scaling, tied output layer (FIXTURE_VARIANT=qwen2)
MCORE_QWEN2 = os.path.join(HERE, "fixtures", "megatron_qwen2_tp2")
VOCAB = 100
ROPE_LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _tokens(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _our_model(load_dir: str) -> GPTModel:
    """Our unsharded GPT built from a checkpoint folder's stored model description (ours or Megatron-LM's), with
    its weights merged from any TP/PP layout and loaded strictly."""
    try:
        loaded = read_our_checkpoint(load_dir, load_optim=False, load_rng=False)
    except CheckpointFormatError:  # Megatron-LM's legacy files or torch_dist
        loaded = read_megatron_checkpoint(load_dir, load_optim=False, load_rng=False)
    dims = dims_from_args(loaded.args_dict)
    full = merge_tp_pp(loaded.model_state_per_rank, GPT, tied=dims.tied_embeddings, dims=dims)
    spec = dataclasses.replace(spec_from_saved(loaded.args_dict), padded_vocab_size=dims.padded_vocab_size)
    model = GPTModel(TransformerConfig.from_spec(spec, attention_dropout=0.0, hidden_dropout=0.0),
                     ParallelState.single())
    model.load_state_dict(full, strict=True)
    return model.eval()


def _our_logits(load_dir: str, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _our_model(load_dir)(ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :VOCAB]


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _mcore_rank_states(root: str, iteration: str = "release"):
    return [load_megatron_file(os.path.join(root, iteration, f"mp_rank_{t:02d}", "model_optim_rng.pt"))
            for t in range(2)]


def _hf_model(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)
    torch.manual_seed(11)
    if kind == "llama":  # grouped-query attention, RoPE 500000 with Llama 3.1's scaling, untied, no biases
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            rope_parameters=ROPE_LLAMA31, tie_word_embeddings=False, eos_token_id=2, **common))
    else:  # Qwen2: biases on q, k, v only; tied
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True, **common))
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a swapped mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize("kind,architecture", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_hugging_face_in_at_tp2_and_out_again(tmp_path, capsys, kind, architecture):
    hf = _hf_model(kind)
    src, ours, back = str(tmp_path / "hf"), str(tmp_path / "ours"), str(tmp_path / "back")
    hf.save_pretrained(src)
    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "hf", "--saver", "ours", "--load-dir", src,
                        "--save-dir", ours, "--target-tensor-parallel-size", "2")
    assert rc == 0, err
    assert "vocabulary 100 padded to 128" in out and "--num-query-groups 2" in out
    ids = _tokens()
    want = _hf_logits(hf, ids)
    torch.testing.assert_close(_our_logits(ours, ids), want, rtol=1e-5, atol=1e-5)  # TP 2 files, merged

    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "ours", "--saver", "hf", "--load-dir", ours,
                        "--save-dir", back)
    assert rc == 0, err
    assert f"written as {architecture}" in out
    again = transformers.AutoModelForCausalLM.from_pretrained(back, local_files_only=True).eval()
    assert type(again).__name__ == architecture
    torch.testing.assert_close(_hf_logits(again, ids), want, rtol=1e-5, atol=1e-5)
    config = json.load(open(os.path.join(back, "config.json")))
    assert (config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == \
        (2, VOCAB, kind == "qwen2")
    if kind == "llama":
        assert {k: config["rope_scaling"][k] for k in ("rope_type", "factor", "original_max_position_embeddings")} \
            == {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("fixture", [MCORE, MCORE_QWEN2], ids=["llama", "qwen2"])
def test_megatron_core_checkpoint_gives_its_logits_and_reshards_back_to_its_files(tmp_path, capsys, fixture):
    """Megatron-Core's TP-2 files (per-rank [gate; up], one query group per rank; for the Qwen2 twin also each
    rank's QKV bias and a tied output layer) -> ours TP 1 (its golden logits) -> Megatron-LM layout TP 1 x PP 2 ->
    ours TP 2 -> Megatron-LM layout TP 2: the last files are Megatron-Core's, key for key (``_extra_state``
    entries included) and tensor for tensor; Megatron-Core loaded such files with its logits (the record)."""
    golden = torch.load(os.path.join(fixture, "golden.pt"), weights_only=True)
    steps = [("megatron", "ours", fixture, "ours1", "1", "1"), ("ours", "megatron", "ours1", "mg_pp2", "1", "2"),
             ("megatron", "ours", "mg_pp2", "ours_tp2", "2", "1"), ("ours", "megatron", "ours_tp2", "mg_tp2", "2", "1")]
    for loader, saver, src, dst, tp, pp in steps:
        src = src if os.path.isabs(src) else str(tmp_path / src)
        rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", src,
                          "--save-dir", str(tmp_path / dst), "--target-tensor-parallel-size", tp,
                          "--target-pipeline-parallel-size", pp)
        assert rc == 0, err
    torch.testing.assert_close(_our_logits(str(tmp_path / "ours1"), golden["tokens"]), golden["logits"][..., :VOCAB],
                               rtol=1e-5, atol=1e-5)
    assert sorted(d for d in os.listdir(tmp_path / "mg_pp2" / "release") if d.startswith("mp_rank_")) \
        == ["mp_rank_00_000", "mp_rank_00_001"]
    record = json.load(open(os.path.join(fixture, "megatron_core_loads_ours.json")))
    assert record["max_abs_logit_difference"] == 0.0
    assert any(k.endswith("linear_qkv.bias") for k in record["loaded_keys"]) == (fixture == MCORE_QWEN2)
    if fixture == MCORE_QWEN2:  # and out to Hugging Face, detected as Qwen2 (biases on QKV only): the same logits
        rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
                            fixture, "--save-dir", str(tmp_path / "hf"))
        assert rc == 0 and "Qwen2ForCausalLM" in out + err, err
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
        assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.config.tie_word_embeddings
        torch.testing.assert_close(_hf_logits(hf.eval(), golden["tokens"]), golden["logits"][..., :VOCAB],
                                   rtol=1e-5, atol=1e-5)
    for theirs, written in zip(_mcore_rank_states(fixture), _mcore_rank_states(str(tmp_path / "mg_tp2"))):
        assert list(written["model"]) == list(theirs["model"])
        assert sorted(written["model"]) == record["loaded_keys"]  # what Megatron-Core loaded with strict=True
        for name, value in theirs["model"].items():
            if torch.is_tensor(value):
                assert torch.equal(written["model"][name], value), name
        for key in record["args_checked"]:
            assert getattr(written["args"], key) == getattr(theirs["args"], key), key


def test_megatron_core_torch_dist_checkpoint_gives_its_logits(tmp_path, capsys):
    """Megatron-Core's ``torch_dist`` files of the same TP-2 model (layers stacked, its global ``[gate; up]``) give
    the legacy files' weights exactly and Megatron-Core's logits; our ``--saver torch_dist`` files read back to the
    same weights (Megatron-Core loading them at TP 2 gave its logits exactly: the generator's record)."""
    golden = torch.load(os.path.join(MCORE, "golden.pt"), weights_only=True)
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "torch_dist", "--load-dir",
                      MCORE, "--save-dir", str(tmp_path / "our_dist"))  # what Megatron-Core loaded (record below)
    assert rc == 0, err
    for src, dst in ((MCORE_DIST, "from_dist"), (MCORE, "from_legacy"), (str(tmp_path / "our_dist"), "from_ours")):
        rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir", src,
                          "--save-dir", str(tmp_path / dst), "--target-tensor-parallel-size", "1")
        assert rc == 0, err
    legacy_sd = _our_model(str(tmp_path / "from_legacy")).state_dict()
    for other in ("from_dist", "from_ours"):
        other_sd = _our_model(str(tmp_path / other)).state_dict()
        assert list(other_sd) == list(legacy_sd)
        for name, value in legacy_sd.items():
            assert torch.equal(other_sd[name], value), (other, name)
    record = json.load(open(os.path.join(MCORE, "megatron_core_loads_our_torch_dist.json")))
    assert record["format"] == "torch_dist" and record["max_abs_logit_difference"] == 0.0
    for load_dir in (str(tmp_path / "from_dist"), MCORE_DIST):
        torch.testing.assert_close(_our_logits(load_dir, golden["tokens"]), golden["logits"][..., :VOCAB],
                                   rtol=1e-5, atol=1e-5)


def test_trained_llama_checkpoint_in_megatron_layout_exports_to_hugging_face(tmp_path, capsys):
    """``pretrain_gpt.py`` with the Llama flags at TP 2 saves Megatron-LM's layout (the rank files of Megatron-Core's
    own TP-2 checkpoint of these sizes, key for key and shape for shape); ``--saver hf`` gives a LlamaForCausalLM
    with our logits."""
    ckpt, hf_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_pretrain(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
                  "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "16",
                  "--max-position-embeddings", "16", "--position-embedding-type", "rope", "--rotary-base", "500000",
                  "--use-rope-scaling", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
                  "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--tokenizer-type",
                  "NullTokenizer", "--vocab-size", "99", "--make-vocab-size-divisible-by", "64", "--mock-data",
                  "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
                  "--attention-dropout", "0", "--hidden-dropout", "0", "--tensor-model-parallel-size", "2",
                  "--eval-iters", "0", "--num-workers", "0", "--save", ckpt, "--ckpt-layout", "megatron"], nproc=2)
    for theirs, ours in zip(_mcore_rank_states(MCORE), _mcore_rank_states(ckpt, "iter_0000003")):
        assert [(k, tuple(v.shape) if torch.is_tensor(v) else v) for k, v in ours["model"].items()] == \
            [(k, tuple(v.shape) if torch.is_tensor(v) else v) for k, v in theirs["model"].items()]
    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", ckpt,
                        "--save-dir", hf_dir)
    assert rc == 0, err
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = _tokens(seed=8)
    torch.testing.assert_close(_hf_logits(hf, ids), _our_logits(ckpt, ids), rtol=1e-5, atol=1e-5)


def test_configurations_the_model_cannot_hold_are_one_line(tmp_path, capsys):
    folder = tmp_path / "mistral"
    folder.mkdir()
    config = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 96, "max_position_embeddings": 64, "vocab_size": VOCAB, "sliding_window": 16}
    (folder / "config.json").write_text(json.dumps(config))
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "hf", "--saver", "ours", "--load-dir", str(folder),
                      "--save-dir", str(tmp_path / "out"))
    assert rc == 2 and err.count("\n") == 1
    assert "config.json: sliding_window 16 is not supported" in err
    assert not (tmp_path / "out").exists()
    # two query groups do not split over four tensor-parallel ranks (Megatron keeps each group whole)
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir", MCORE,
                      "--save-dir", str(tmp_path / "tp4"), "--target-tensor-parallel-size", "4")
    assert rc == 2 and err.count("\n") == 1 and "--target-tensor-parallel-size 4" in err and "linear_qkv" in err
    assert not (tmp_path / "tp4").exists()
