"""Megatron-LM checkpoints from before Megatron-Core (``language_model.encoder…`` keys, ``checkpoint_version`` 0, 1,
2, 3 with their QKV orders), as NVIDIA's published 345M GPT and BERT checkpoints and the how-tos of that time have
them. Each file is written here from a random Hugging Face model in the documented layout of its version; it
converts with ``tools/checkpoint/convert.py`` and loads with ``--load`` (``--finetune``), and our model then gives
the Hugging Face model's logits (GPT2LMHeadModel; MegatronBertForPreTraining for BERT: MLM and binary head). The
345M sizes: a shape check here, a full conversion opt-in (``MEGATRON_LITE_345M=1``)."""

import argparse
import os

import pytest
import torch

from megatron.core.checkpoint_formats import BERT, GPT, dims_from_args, read_megatron_checkpoint, read_our_checkpoint
from megatron.core.checkpoint_formats.megatron_precore import core_view
from megatron.core.parallel_state import ParallelState
from tests.unit.checkpoint.bert_helpers import batch, bert_dims, our_outputs
from tests.unit.checkpoint.helpers import build_stage, single_logits
from tests.unit.checkpoint.test_convert import _run

transformers = pytest.importorskip("transformers")

HEADS = 4
# each version's stored QKV rows, as axes of (part q/k/v, head, channel) -> from Hugging Face's [3, np, hn] blocks
STORED = {0: (0, 1, 2), 1: (1, 2, 0), 2: (1, 0, 2), 3: (1, 0, 2)}


def _stored_qkv(blocks: torch.Tensor, version: int, heads: int) -> torch.Tensor:
    """``[3h, ...]`` rows in Q|K|V blocks (Hugging Face's order) laid out as ``checkpoint_version`` stores them."""
    hn = blocks.shape[0] // (3 * heads)
    return blocks.reshape(3, heads, hn, *blocks.shape[1:]).permute(*STORED[version], *range(3, blocks.dim() + 2)) \
        .reshape(blocks.shape).clone()


def _layers(prefix: str, n: int, get, version: int, heads: int) -> dict:
    """The pre-Core layer entries ``layers.N.…`` from ``get(i, part)`` of a Hugging Face model."""
    attn = "attention" if version < 3 else "self_attention"  # files of both names exist
    out = {}
    for i in range(n):
        qkv_w, qkv_b = get(i, "qkv")
        for key, value in {"input_layernorm": get(i, "ln1"), f"{attn}.query_key_value": (
                _stored_qkv(qkv_w, version, heads), _stored_qkv(qkv_b, version, heads)),
                f"{attn}.dense": get(i, "proj"), "post_attention_layernorm": get(i, "ln2"),
                "mlp.dense_h_to_4h": get(i, "fc1"), "mlp.dense_4h_to_h": get(i, "fc2")}.items():
            out[f"layers.{i}.{key}.weight"], out[f"layers.{i}.{key}.bias"] = value
    return out


def _save(root, state: dict, version) -> str:
    if version is not None:
        state["checkpoint_version"] = float(version)
    os.makedirs(os.path.join(root, "release", "mp_rank_00"))
    torch.save(state, os.path.join(root, "release", "mp_rank_00", "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    return str(root)


# ---- GPT ------------------------------------------------------------------------------------------------------------
def _hf_gpt2(hidden=32, layers=2, heads=HEADS, vocab=64, positions=16):
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
                                     n_head=heads, activation_function="gelu", layer_norm_epsilon=1e-5,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # non-trivial norms and biases
            if "ln_" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def precore_gpt(hf, version, tied_dict_layout: bool = True) -> dict:
    """The ``model`` entry of a pre-Core GPT file holding ``hf``'s weights (Conv1D weights transposed)."""
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    h = f"transformer.h."

    def get(i, part):
        p = f"{h}{i}."
        return {"ln1": (sd[p + "ln_1.weight"], sd[p + "ln_1.bias"]),
                "qkv": (sd[p + "attn.c_attn.weight"].t(), sd[p + "attn.c_attn.bias"]),
                "proj": (sd[p + "attn.c_proj.weight"].t(), sd[p + "attn.c_proj.bias"]),
                "ln2": (sd[p + "ln_2.weight"], sd[p + "ln_2.bias"]),
                "fc1": (sd[p + "mlp.c_fc.weight"].t(), sd[p + "mlp.c_fc.bias"]),
                "fc2": (sd[p + "mlp.c_proj.weight"].t(), sd[p + "mlp.c_proj.bias"])}[part]

    stack = _layers("", hf.config.n_layer, get, version or 0, hf.config.n_head)
    stack["final_layernorm.weight"], stack["final_layernorm.bias"] = sd["transformer.ln_f.weight"], \
        sd["transformer.ln_f.bias"]
    return {"language_model": {
        "embedding": {"word_embeddings": {"weight": sd["transformer.wte.weight"]},
                      "position_embeddings": {"weight": sd["transformer.wpe.weight"]}},
        ("transformer" if not version else "encoder"): stack}}


def _gpt_args(hf) -> argparse.Namespace:
    c = hf.config
    return argparse.Namespace(num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
                              max_position_embeddings=c.n_positions, seq_length=c.n_positions,
                              padded_vocab_size=c.vocab_size, make_vocab_size_divisible_by=c.vocab_size,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              tokenizer_type="GPT2BPETokenizer", iteration=0)


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize("version", [None, 1, 2, 3], ids=["v0", "v1", "v2", "v3"])
def test_precore_gpt_converts_and_loads_with_hugging_faces_logits(tmp_path, capsys, version):
    from megatron.training import checkpointing
    from tests.unit.checkpoint.test_trainer_load import _cfg

    hf = _hf_gpt2()
    root = _save(tmp_path / "precore", {"args": _gpt_args(hf), "iteration": 5000, "model": precore_gpt(hf, version),
                                        "random_rng_state": None}, version)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    want = _hf_logits(hf, tokens)
    ours = str(tmp_path / "ours")
    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                        root, "--save-dir", ours)
    assert rc == 0, err
    loaded = read_our_checkpoint(ours)
    dims = dims_from_args(loaded.args_dict)
    got = single_logits(loaded.model_state_per_rank[(0, 0)][0], dims, tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # --load (--finetune: a pre-Core file is read for its weights) into a randomly initialised model
    model = build_stage(dims, ParallelState.single(), seed=9)
    assert checkpointing.load_checkpoint([model], None, None, _cfg(root, finetune=True),
                                         ParallelState.single()) == (0, 0)
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, pos), want, atol=1e-4, rtol=1e-4)


def test_qkv_versions_differ_and_a_wrong_version_gives_other_logits(tmp_path):
    """The check can fail: a version-0 file labelled 2.0 reads its QKV rows in another order."""
    hf = _hf_gpt2()
    state = {"args": _gpt_args(hf), "model": precore_gpt(hf, 0), "checkpoint_version": 2.0}
    root = _save(tmp_path / "p", state, None)
    full = read_megatron_checkpoint(root, load_optim=False, load_rng=False).model_state_per_rank[(0, 0)][0]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    got = single_logits(full, dims_from_args(_gpt_args(hf).__dict__), tokens)
    assert (got - _hf_logits(hf, tokens)).abs().max() > 1e-2


def test_a_file_without_arguments_needs_the_heads_and_unknown_keys_are_named(tmp_path, capsys):
    hf = _hf_gpt2()
    root = _save(tmp_path / "noargs", {"iteration": 0, "model": precore_gpt(hf, None)}, None)
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir", root,
                      "--save-dir", str(tmp_path / "o1"))
    assert rc == 2 and "stores no arguments; give the model's --num-attention-heads" in err
    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir", root,
                        "--save-dir", str(tmp_path / "o2"), "--num-attention-heads", str(HEADS))
    assert rc == 0, err
    full = read_our_checkpoint(str(tmp_path / "o2")).model_state_per_rank[(0, 0)][0]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    got = single_logits(full, dims_from_args(_gpt_args(hf).__dict__), tokens)
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
    bad = precore_gpt(hf, 2)
    bad["language_model"]["encoder"]["layers.0.attention.rotary.weight"] = torch.zeros(1)
    with pytest.raises(Exception, match="layers.0.attention.rotary.weight is not a parameter of a pre-Core"):
        core_view({"args": _gpt_args(hf), "model": bad, "checkpoint_version": 2.0}, GPT, 1, None, "f.pt")


def test_345m_shapes_map_to_our_gpt_and_bert_layouts():
    """NVIDIA's published 345M sizes (24 layers, hidden 1024, 16 heads, GPT vocabulary 50257 padded to 50304,
    BERT 30522 padded to 30592, 1024/512 positions): every pre-Core name maps and every shape fits our layout
    (meta tensors: nothing is allocated)."""
    for family, vocab, positions in ((GPT, 50304, 1024), (BERT, 30592, 512)):
        h, layers, heads = 1024, 24, 16
        m = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
        stack = {}
        for i in range(layers):
            for key, (w, b) in {"input_layernorm": ((h,), (h,)), "attention.query_key_value": ((3 * h, h), (3 * h,)),
                                "attention.dense": ((h, h), (h,)), "post_attention_layernorm": ((h,), (h,)),
                                "mlp.dense_h_to_4h": ((4 * h, h), (4 * h,)),
                                "mlp.dense_4h_to_h": ((h, 4 * h), (h,))}.items():
                stack[f"layers.{i}.{key}.weight"], stack[f"layers.{i}.{key}.bias"] = m(*w), m(*b)
        stack["final_layernorm.weight"], stack["final_layernorm.bias"] = m(h), m(h)
        model = {"language_model": {"embedding": {"word_embeddings": {"weight": m(vocab, h)},
                                                  "position_embeddings": {"weight": m(positions, h)}},
                                    "transformer": stack}}
        if family is BERT:
            model["language_model"]["embedding"]["tokentype_embeddings"] = {"weight": m(2, h)}
            model["language_model"]["pooler"] = {"dense.weight": m(h, h), "dense.bias": m(h)}
            model["lm_head"] = {"dense.weight": m(h, h), "dense.bias": m(h), "layernorm.weight": m(h),
                                "layernorm.bias": m(h), "bias": m(vocab)}
            model["binary_head"] = {"weight": m(2, h), "bias": m(2)}
        args = argparse.Namespace(num_layers=layers, hidden_size=h, num_attention_heads=heads,
                                  max_position_embeddings=positions, padded_vocab_size=vocab)
        full = core_view({"args": args, "model": model}, family, 1, None, "345m.pt")["model"]
        family.check_shapes(full, dims_from_args(vars(args)), "345m.pt")
        assert len(full) == 4 + 12 * layers + (10 if family is BERT else 0)


@pytest.mark.skipif(not os.environ.get("MEGATRON_LITE_345M"), reason="opt-in (about 2 minutes, 6 GB): set "
                    "MEGATRON_LITE_345M=1 to convert a pre-Core file at NVIDIA's 345M GPT sizes")
def test_345m_gpt_precore_file_converts_with_hugging_faces_logits(tmp_path, capsys):
    """The 345M GPT (24 layers, hidden 1024, 16 heads, 1024 positions, 50257 tokens) as a version-0 release file
    without arguments, as published: converts with --num-attention-heads 16 and gives Hugging Face's logits."""
    hf = _hf_gpt2(hidden=1024, layers=24, heads=16, vocab=50257, positions=1024)
    root = _save(tmp_path / "precore", {"iteration": 0, "model": precore_gpt(hf, None)}, None)
    ours = str(tmp_path / "ours")
    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                        root, "--save-dir", ours, "--num-attention-heads", "16")
    assert rc == 0, err
    assert "354,823,168 parameters (24 layers, hidden 1024, 16 heads, FFN 4096" in out
    loaded = read_our_checkpoint(ours)
    tokens = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(1))
    got = single_logits(loaded.model_state_per_rank[(0, 0)][0], dims_from_args(loaded.args_dict), tokens)
    torch.testing.assert_close(got[..., :50257], _hf_logits(hf, tokens), atol=2e-4, rtol=2e-4)


# ---- BERT -----------------------------------------------------------------------------------------------------------
def precore_bert(hf, version) -> dict:
    """The ``model`` entry of a pre-Core BERT file holding ``MegatronBertForPreTraining`` ``hf``'s weights."""
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    e = "bert.encoder.layer."

    def get(i, part):
        p = f"{e}{i}."
        pair = lambda n: (sd[p + n + ".weight"], sd[p + n + ".bias"])  # noqa: E731
        if part == "qkv":
            parts = [pair(f"attention.self.{x}") for x in ("query", "key", "value")]
            return torch.cat([w for w, _ in parts]), torch.cat([b for _, b in parts])
        return pair({"ln1": "attention.ln", "proj": "attention.output.dense", "ln2": "ln",
                     "fc1": "intermediate.dense", "fc2": "output.dense"}[part])

    stack = _layers("", hf.config.num_hidden_layers, get, version or 0, hf.config.num_attention_heads)
    stack["final_layernorm.weight"], stack["final_layernorm.bias"] = sd["bert.encoder.ln.weight"], \
        sd["bert.encoder.ln.bias"]
    emb = "bert.embeddings."
    return {"language_model": {
        "embedding": {"word_embeddings": {"weight": sd[emb + "word_embeddings.weight"]},
                      "position_embeddings": {"weight": sd[emb + "position_embeddings.weight"]},
                      "tokentype_embeddings": {"weight": sd[emb + "token_type_embeddings.weight"]}},
        "encoder": stack,
        "pooler": {"dense.weight": sd["bert.pooler.dense.weight"], "dense.bias": sd["bert.pooler.dense.bias"]}},
        "lm_head": {"dense.weight": sd["cls.predictions.transform.dense.weight"],
                    "dense.bias": sd["cls.predictions.transform.dense.bias"],
                    "layernorm.weight": sd["cls.predictions.transform.LayerNorm.weight"],
                    "layernorm.bias": sd["cls.predictions.transform.LayerNorm.bias"],
                    "bias": sd["cls.predictions.bias"]},
        "binary_head": {"weight": sd["cls.seq_relationship.weight"], "bias": sd["cls.seq_relationship.bias"]}}


@pytest.mark.parametrize("version", [None, 1, 3], ids=["v0", "v1", "v3"])
def test_precore_bert_converts_and_loads_with_megatron_berts_outputs(tmp_path, capsys, version):
    vocab = 24
    dims = bert_dims(vocab)
    config = transformers.MegatronBertConfig(vocab_size=vocab, hidden_size=dims.hidden_size,
                                             num_hidden_layers=dims.num_layers, num_attention_heads=HEADS,
                                             intermediate_size=dims.ffn_hidden_size, hidden_act="gelu",
                                             max_position_embeddings=dims.max_position_embeddings,
                                             type_vocab_size=2, layer_norm_eps=dims.layernorm_epsilon,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    hf = transformers.MegatronBertForPreTraining(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln" in name or "LayerNorm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    args = argparse.Namespace(num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=HEADS,
                              ffn_hidden_size=dims.ffn_hidden_size, max_position_embeddings=dims.max_position_embeddings,
                              seq_length=dims.max_position_embeddings, padded_vocab_size=vocab, vocab_size=vocab,
                              make_vocab_size_divisible_by=8, layernorm_epsilon=dims.layernorm_epsilon,
                              bert_binary_head=True, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    root = _save(tmp_path / "precore", {"args": args, "iteration": 0, "model": precore_bert(hf, version)}, version)
    ours = str(tmp_path / "ours")
    rc, _, err = _run(capsys, "--model-type", "BERT", "--loader", "megatron", "--saver", "ours", "--load-dir", root,
                      "--save-dir", ours)
    assert rc == 0, err
    from megatron.training import checkpointing
    from tests.unit.checkpoint.bert_helpers import bert_model
    from tests.unit.checkpoint.test_trainer_load import _cfg

    ids, types, padding = batch(vocab)
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=padding)
    mask = padding.bool()
    direct = bert_model(dims, post_ln=False)  # --load (--finetune) of the pre-Core folder itself
    checkpointing.load_checkpoint([direct], None, None, _cfg(root, finetune=True), ParallelState.single())
    for full in (read_our_checkpoint(ours).model_state_per_rank[(0, 0)][0], direct.state_dict()):
        _, logits, binary = our_outputs(full, dims, post_ln=False, vocab=vocab)
        # MLM logits at the real tokens (padding positions differ in how the two mask them), and the binary head
        torch.testing.assert_close(logits[mask], ref.prediction_logits[mask], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(binary, ref.seq_relationship_logits, atol=1e-4, rtol=1e-4)
