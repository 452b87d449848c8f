"""The BERT model against Hugging Face ``transformers`` (pre-LN ``MegatronBertForPreTraining`` and post-LN
``BertForPreTraining``) with padded batches, plus names, loss, recomputation and the weight mapping."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.bert import BertModel, initialize_bert_parameters
from megatron.core.models.bert_hf_mapping import hf_to_megatron_bert, is_post_ln_checkpoint, megatron_to_hf_bert
from megatron.core.models.bert_loss import bert_loss_func, get_bert_batch, make_bert_forward_step, max_masked_positions
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.core.transformer.config import TransformerConfig

transformers = pytest.importorskip("transformers")

VOCAB, PADDED, H, HEADS, LAYERS, FFN, SEQ = 100, 128, 32, 4, 3, 64, 16


@pytest.fixture(autouse=True)
def _seed():
    model_parallel_seed(1234, ParallelState.single())


def _config(post_ln=False, **kw):
    base = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN, seq_length=SEQ,
                max_position_embeddings=SEQ, padded_vocab_size=PADDED, attention_dropout=0.0, hidden_dropout=0.0,
                layernorm_epsilon=1e-12, attention_mask_type="padding",
                apply_residual_connection_post_layernorm=post_ln)
    base.update(kw)
    return TransformerConfig(**base)


def _hf_model(post_ln: bool):
    kw = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
              intermediate_size=FFN, max_position_embeddings=SEQ, type_vocab_size=2, hidden_act="gelu",
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)
    torch.manual_seed(0)
    if post_ln:
        model = transformers.BertForPreTraining(transformers.BertConfig(**kw, attn_implementation="eager"))
    else:
        model = transformers.MegatronBertForPreTraining(
            transformers.MegatronBertConfig(**kw, attn_implementation="eager"))
    with torch.no_grad():  # LayerNorms and biases away from (1, 0): every mapped tensor matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    types = torch.zeros(3, SEQ, dtype=torch.long)
    types[:, 7:] = 1
    lengths = torch.tensor([SEQ, 11, 6])
    padding = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [b, s], 1 = token
    return ids, types, padding


@pytest.mark.parametrize("post_ln", [False, True], ids=["pre_ln_megatron_bert", "post_ln_bert"])
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_matches_hugging_face(post_ln, backend):
    hf = _hf_model(post_ln)
    assert is_post_ln_checkpoint(hf.state_dict()) == post_ln
    cfg = _config(post_ln, attention_backend=backend)
    model = BertModel(cfg, ParallelState.single()).eval()
    missing, unexpected = model.load_state_dict(hf_to_megatron_bert(hf.state_dict(), LAYERS, HEADS, PADDED),
                                                strict=True)
    assert not missing and not unexpected
    ids, types, padding = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=padding, output_hidden_states=True)
        captured = {}
        model.encoder.register_forward_hook(lambda m, i, o: captured.update(hidden=o))  # returns None: no change
        logits, binary = model(ids, padding, tokentype_ids=types)
    # the encoder output (after the final LayerNorm) at every position, padded ones included (keys are masked)
    torch.testing.assert_close(captured["hidden"].transpose(0, 1), ref.hidden_states[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[..., :VOCAB], ref.prediction_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(binary, ref.seq_relationship_logits, rtol=1e-5, atol=1e-5)
    # padded vocabulary rows: zero embedding and bias, so their logits are exactly 0
    assert torch.all(logits[..., VOCAB:] == 0)

    # the loss against Hugging Face's logits: MLM loss over the loss mask plus the binary-head loss
    labels = torch.full_like(ids, -1)
    loss_mask = torch.zeros(3, SEQ)
    for b, pos in enumerate(([1, 4, 9, 15], [2, 3, 10], [1, 5])):
        labels[b, pos] = torch.randint(0, VOCAB, (len(pos),), generator=torch.Generator().manual_seed(b))
        loss_mask[b, pos] = 1.0
    is_random = torch.tensor([0, 1, 1])
    with torch.no_grad():
        out = model(ids, padding, tokentype_ids=types, lm_labels=labels)
    loss, report = bert_loss_func(loss_mask, is_random, out)
    sel = loss_mask.bool()
    # the softmax runs over the padded vocabulary, whose rows are zero here (logit 0)
    hf_padded = F.pad(ref.prediction_logits, (0, PADDED - VOCAB))
    lm_ref = F.cross_entropy(hf_padded[sel], labels[sel])
    sop_ref = F.cross_entropy(ref.seq_relationship_logits, is_random)
    torch.testing.assert_close(report["lm loss"], lm_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(report["sop loss"], sop_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, lm_ref + sop_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("post_ln", [False, True])
def test_hugging_face_round_trip(post_ln):
    hf_sd = _hf_model(post_ln).state_dict()
    ours = hf_to_megatron_bert(hf_sd, LAYERS, HEADS, PADDED)
    back = megatron_to_hf_bert(ours, LAYERS, HEADS, VOCAB, post_ln)
    expected = {k for k in hf_sd if not k.endswith("position_ids")}
    assert set(back) == expected
    for k in expected:
        torch.testing.assert_close(back[k], hf_sd[k], rtol=0, atol=0, msg=k)


def test_padding_changes_nothing_at_real_tokens():
    """Appending padding (masked keys) leaves the outputs of the real tokens unchanged."""
    cfg = _config()
    ps = ParallelState.single()
    model = BertModel(cfg, ps).eval()
    initialize_bert_parameters(model, 5, cfg, ps)
    ids, types, _ = _batch()
    short = torch.ones(3, 10, dtype=torch.long)
    padded = torch.zeros(3, SEQ, dtype=torch.long)
    padded[:, :10] = 1
    junk = ids.clone()
    junk[:, 10:] = torch.randint(0, VOCAB, (3, SEQ - 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a, ba = model(ids[:, :10], short, tokentype_ids=types[:, :10])
        b, bb = model(junk, padded, tokentype_ids=types)
    torch.testing.assert_close(b[:, :10], a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bb, ba, rtol=1e-5, atol=1e-5)


def test_parameter_names_follow_megatron_core():
    ps = ParallelState.single()
    names = set(BertModel(_config(num_layers=1), ps).state_dict())
    layer = {f"encoder.layers.0.{m}.{leaf}" for m in (
        "input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj", "pre_mlp_layernorm",
        "mlp.linear_fc1", "mlp.linear_fc2") for leaf in ("weight", "bias")}
    heads = {f"{m}.{leaf}" for m in ("encoder.final_layernorm", "lm_head.dense", "lm_head.layer_norm",
                                     "pooler.dense", "binary_head") for leaf in ("weight", "bias")}
    emb = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
    assert names == emb | {"embedding.tokentype_embeddings.weight", "output_layer.bias"} | layer | heads
    no_binary = set(BertModel(_config(num_layers=1), ps, num_tokentypes=0, add_binary_head=False).state_dict())
    assert no_binary == emb | {"output_layer.bias"} | layer | {
        f"{m}.{leaf}" for m in ("encoder.final_layernorm", "lm_head.dense", "lm_head.layer_norm")
        for leaf in ("weight", "bias")}
    untied = set(BertModel(_config(num_layers=1, share_embeddings_and_output_weights=False), ps).state_dict())
    assert untied == names | {"output_layer.weight"}
    middle = set(BertModel(_config(num_layers=1), ps, pre_process=False, post_process=False).state_dict())
    assert middle == layer
    last = set(BertModel(_config(num_layers=1), ps, pre_process=False).state_dict())
    assert last == (names - emb - {"embedding.tokentype_embeddings.weight"}) | {"output_layer.weight"}


def test_without_binary_head_the_loss_is_the_mlm_loss():
    cfg = _config()
    ps = ParallelState.single()
    model = BertModel(cfg, ps, num_tokentypes=0, add_binary_head=False)
    initialize_bert_parameters(model, 5, cfg, ps)
    ids, _, padding = _batch()
    labels = ids.masked_fill(torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.3, -1)
    loss_mask = (labels >= 0).float()
    out = model(ids, padding, lm_labels=labels)
    assert out[1] is None
    loss, report = bert_loss_func(loss_mask, None, out)
    assert set(report) == {"lm loss"}
    with torch.no_grad():
        logits, _ = model(ids, padding)
    sel = loss_mask.bool()
    torch.testing.assert_close(loss, F.cross_entropy(logits[sel], labels[sel]), rtol=1e-5, atol=1e-6)


def _sample(ids, types, padding, labels, is_random=(0, 1, 1)):
    return dict(text=ids, types=types, labels=labels, is_random=torch.tensor(is_random),
                loss_mask=(labels >= 0).long(), padding_mask=padding)


def test_the_attention_mask_is_decided_on_the_host():
    """A loader batch without padding runs attention without a mask (SDPA may then take its flash kernel), which
    gives the same outputs; a padded batch, or any batch of a captured step, passes the padding mask."""
    ps = ParallelState.single()
    cfg = _config()
    model = BertModel(cfg, ps).eval()
    initialize_bert_parameters(model, 3, cfg, ps)
    ids, types, padding = _batch()
    labels = torch.full_like(ids, -1)
    full = torch.ones_like(ids)
    assert get_bert_batch(iter([_sample(ids, types, full, labels)]), ps)["attention_mask"] is None
    captured = get_bert_batch(iter([_sample(ids, types, full, labels)]), ps, capturable=True)["attention_mask"]
    assert torch.equal(captured, full)
    padded = get_bert_batch(iter([_sample(ids, types, padding, labels)]), ps)["attention_mask"]
    assert torch.equal(padded, padding)
    seen = []
    model.encoder.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    with torch.no_grad():
        logits, binary = model(ids, None, tokentype_ids=types)
        masked_logits, masked_binary = model(ids, full, tokentype_ids=types)
    assert seen[0] is None and seen[1] is not None and not bool(seen[1].any())
    torch.testing.assert_close(binary, masked_binary, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, masked_logits, rtol=1e-6, atol=1e-6)


def _nonzero_reference(model, ids, types, padding, labels, loss_mask):
    """The projection of the masked positions found with ``nonzero()`` (a host read): per-token loss ``[b, s]``
    and binary logits, written independently of the model's static selection."""
    b, s = ids.shape
    hidden = model.encoder(model.embedding(ids, torch.arange(s).expand_as(ids), types),
                           (padding < 0.5).view(b, 1, 1, s))  # [s, b, h]
    head = model.lm_head(hidden)  # [s, b, h]
    keep = loss_mask.t().reshape(-1).nonzero().squeeze(1)  # [n] rows of s*b
    logits = F.linear(head.reshape(s * b, -1).index_select(0, keep), model.output_weight(),
                      model.output_layer.bias)  # [n, V]
    picked = F.cross_entropy(logits.float(), labels.t().reshape(-1).index_select(0, keep), reduction="none")
    per_token = picked.new_zeros(s * b).index_copy(0, keep, picked).view(s, b).t()  # [b, s]
    return per_token, model.binary_head(model.pooler(hidden))


def test_static_selection_equals_nonzero_and_full_vocabulary_losses_and_gradients():
    """k positions per sample chosen by a sort of the loss mask (no host read) give the loss and every gradient
    of the nonzero() selection and of the full-vocabulary loss over all positions weighted by the loss mask;
    samples with fewer masked positions than k (one with none) fill the slots with weight-0 positions."""
    ps = ParallelState.single()
    cfg = _config()
    model = BertModel(cfg, ps)
    initialize_bert_parameters(model, 7, cfg, ps)
    ids, types, padding = _batch()
    loss_mask = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) < 0.2).long() * padding
    loss_mask[2] = 0  # a sample with nothing masked
    loss_mask[1, :2] = 1
    loss_mask[1, 7] = 1
    k = int(loss_mask.sum(1).max())
    assert 0 < k < SEQ // 2 and int(loss_mask[0].sum()) != int(loss_mask[1].sum())
    labels = ids.masked_fill(loss_mask == 0, -1)
    is_random = torch.tensor([0, 1, 1])
    runs = {"full": dict(), "static": dict(lm_loss_mask=loss_mask, max_masked_positions=k),
            "static+2": dict(lm_loss_mask=loss_mask, max_masked_positions=k + 2), "nonzero": None}
    results = {}
    for name, kw in runs.items():
        model.zero_grad(set_to_none=True)
        if kw is None:
            lm, binary = _nonzero_reference(model, ids, types, padding, labels, loss_mask)
        else:
            lm, binary = model(ids, padding, tokentype_ids=types, lm_labels=labels, **kw)
        loss, _ = bert_loss_func(loss_mask, is_random, (lm, binary))
        loss.backward()
        results[name] = (lm.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    full, full_loss, full_grads = results["full"]
    for name in ("static", "static+2", "nonzero"):
        picked, picked_loss, picked_grads = results[name]
        assert picked.shape == full.shape
        assert torch.count_nonzero(picked[~loss_mask.bool()]) == 0, name
        torch.testing.assert_close(picked[loss_mask.bool()], full[loss_mask.bool()], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(picked_loss, full_loss, rtol=1e-6, atol=1e-6)
        for pname, grad in full_grads.items():
            torch.testing.assert_close(picked_grads[pname], grad, rtol=1e-5, atol=1e-7, msg=f"{name} {pname}")
    # the static selection against the nonzero() one: the same rows, so the same numbers to 1e-6
    static, nonzero = results["static"], results["nonzero"]
    torch.testing.assert_close(static[0], nonzero[0], rtol=1e-6, atol=1e-6)
    for pname, grad in nonzero[2].items():
        torch.testing.assert_close(static[2][pname], grad, rtol=1e-6, atol=1e-7, msg=pname)


def test_masked_loss_needs_the_bound_and_the_loader_batch_respects_it():
    ps = ParallelState.single()
    cfg = _config()
    model = BertModel(cfg, ps)
    ids, types, padding = _batch()
    labels = torch.where(torch.arange(SEQ) % 4 == 1, ids, -1)
    with pytest.raises(ValueError, match="needs max_masked_positions"):
        model(ids, padding, tokentype_ids=types, lm_labels=labels, lm_loss_mask=(labels >= 0).long())
    with pytest.raises(ValueError, match="masks 4 positions, more than the 3 the model projects"):
        make_bert_forward_step(ps, max_masked=3)(iter([_sample(ids, types, padding, labels)]), model)
    assert max_masked_positions(0.15, 512) == 76 and max_masked_positions(0.15, 20) == 3
    assert max_masked_positions(0.01, 16) == 1 and max_masked_positions(0.99, 4) == 3


@pytest.mark.parametrize("granularity,method", [("selective", None), ("full", "uniform"), ("full", "block")])
def test_recompute_gives_same_gradients(granularity, method):
    ps = ParallelState.single()
    ids, types, padding = _batch()
    labels = ids.roll(1, 1)
    grads = []
    for g, m in ((None, None), (granularity, method)):
        cfg = _config(recompute_granularity=g, recompute_method=m, recompute_num_layers=2)
        model = BertModel(cfg, ps)
        initialize_bert_parameters(model, 11, cfg, ps)
        lm, binary = model(ids, padding, tokentype_ids=types, lm_labels=labels)
        (lm.mean() + binary.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-6, atol=1e-7, msg=name)


def test_bad_configuration_is_named():
    ps = ParallelState.single()
    with pytest.raises(ValueError, match="attention_mask_type='padding'"):
        BertModel(_config(attention_mask_type="causal"), ps)
    with pytest.raises(ValueError, match="attention backend flash takes no padding mask"):
        BertModel(_config(attention_backend="flash"), ps)
    with pytest.raises(ValueError, match="attention mask type must be one of causal, padding, got bidir"):
        _config(attention_mask_type="bidir")
    with pytest.raises(ValueError, match="neither bert.embeddings.LayerNorm"):
        is_post_ln_checkpoint({"foo": torch.zeros(1)})


def test_forward_step_reads_megatron_fields_and_names_missing_ones():
    ps = ParallelState.single()
    cfg = _config()
    model = BertModel(cfg, ps)
    initialize_bert_parameters(model, 5, cfg, ps)
    ids, types, padding = _batch()
    labels = torch.where(torch.arange(SEQ) % 3 == 1, ids, -1)
    sample = dict(text=ids, types=types, labels=labels, is_random=torch.tensor([1, 0, 1]),
                  loss_mask=(labels >= 0).long(), padding_mask=padding)
    output, loss_func = make_bert_forward_step(ps, binary_loss_name="nsp loss", max_masked=6)(iter([sample]), model)
    loss, report = loss_func(output)
    assert set(report) == {"lm loss", "nsp loss"}
    # the forward step projects the masked positions only; the loss over every position agrees
    direct = bert_loss_func(sample["loss_mask"], sample["is_random"],
                            model(ids, padding, tokentype_ids=types, lm_labels=labels))[0]
    torch.testing.assert_close(loss, direct, rtol=1e-6, atol=1e-6)
    gpt_sample = {"text": ids}
    with pytest.raises(ValueError, match="missing types, labels, is_random, loss_mask, padding_mask"):
        make_bert_forward_step(ps)(iter([gpt_sample]), model)


def test_fp8_layers_track_bf16():
    """The encoder's FP8 GEMMs (the GPT's FP8 path) under the padding mask stay close to the bf16 model."""
    ps = ParallelState.single()
    ids, types, padding = _batch()
    ids, types, padding = ids[:2], types[:2], padding[:2]  # 32 tokens: FP8 GEMM sizes are multiples of 16
    labels = torch.where(torch.arange(SEQ) % 4 == 1, ids, -1)
    results = []
    for fp8 in (None, "e4m3"):
        cfg = _config(params_dtype=torch.bfloat16, fp8=fp8, ffn_hidden_size=128)
        model = BertModel(cfg, ps)
        initialize_bert_parameters(model, 13, cfg, ps)
        lm, binary = model(ids, padding, tokentype_ids=types, lm_labels=labels)
        loss, _ = bert_loss_func((labels >= 0).float(), torch.tensor([0, 1]), (lm, binary))
        loss.backward()
        qkv = model.encoder.layers[0].self_attention.linear_qkv.weight.grad.float()
        results.append((loss.detach().float(), qkv))
    (loss_bf16, g_bf16), (loss_fp8, g_fp8) = results
    assert torch.isfinite(loss_fp8) and abs(loss_fp8 - loss_bf16) / loss_bf16 < 0.02, (loss_fp8, loss_bf16)
    assert (g_fp8 - g_bf16).norm() / g_bf16.norm() < 0.15
    assert not torch.equal(g_fp8, g_bf16)  # the FP8 path did run
