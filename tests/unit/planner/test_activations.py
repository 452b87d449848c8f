"""The planner's activation bytes per layer equal what autograd really keeps, they equal Korthikanti et al.
2022's Eq. 1-6 up to differences named with their size, and the planner's in-flight microbatch counts follow the
1F1B / interleaved schedules."""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.parallel_state import ParallelState
from megatron.core.planner import Layout, ModelShape
from megatron.core.planner.memory import in_flight_peak, layer_activation_bytes
from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.rope import RotaryEmbedding
from tests.dist_utils import run_distributed

S, B = 64, 2


def saved_bytes_per_layer(pstate, h, a, ffn, layout: Layout, dropout: float, layers: int = 2,
                          attention_dropout: float = 0.0, s: int = S, **options) -> float:
    """Bytes of the distinct storages autograd saves in one forward pass of a block, parameters excluded (a
    storage shared by several saved tensors, e.g. q, k and v as views of one QKV output, counts once). ``options``:
    further model options (TransformerConfig fields); with RoPE the block gets the angles the model computes."""
    tensor_parallel.model_parallel_seed(1234, pstate)
    mode = layout.recompute_granularity
    cfg = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=a, ffn_hidden_size=ffn,
                            seq_length=s, attention_dropout=attention_dropout, hidden_dropout=dropout,
                            params_dtype=torch.bfloat16, sequence_parallel=layout.sp,
                            attention_backend=layout.attention_backend,
                            recompute_granularity=mode, recompute_method="uniform" if mode == "full" else None,
                            recompute_num_layers=1 if mode == "full" else None,
                            recompute_modules=layout.recompute_modules,
                            fp8="hybrid" if layout.precision == "fp8" else None, **options)
    block = TransformerBlock(cfg, pstate, layers, post_layer_norm=False)
    rotary = None
    if cfg.position_embedding_type == "rope":
        rope = RotaryEmbedding(cfg)
        rotary = rope(rope.positions(s, None, torch.device("cpu")))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    block.train()
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(s // pstate.tp_size if layout.sp else s, B, h, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, rotary_pos_emb=rotary)
    out.float().sum().backward()
    return sum(seen.values()) / layers


def _predicted(h, a, ffn, layout, dropout, attention_dropout=0.0, s=S, device="cpu", **options):
    shape = ModelShape(num_layers=2, hidden_size=h, num_attention_heads=a, ffn_hidden_size=ffn, seq_length=s,
                       attention_dropout=attention_dropout, hidden_dropout=dropout, **options)
    mode = {None: "none"}.get(layout.recompute_granularity, layout.recompute_granularity)
    return layer_activation_bytes(shape, layout, mode, device)


CASES = [  # (h, a, ffn, recompute, modules, precision, dropout)
    (64, 4, None, None, ("core_attn", "mlp_act"), "bf16", 0.0),
    (64, 4, None, None, ("core_attn", "mlp_act"), "bf16", 0.1),
    (128, 2, 384, None, ("core_attn", "mlp_act"), "bf16", 0.1),
    (64, 4, None, "selective", ("core_attn", "mlp_act"), "bf16", 0.1),
    (64, 8, None, "selective", ("mlp_act",), "bf16", 0.0),
    (64, 4, None, "selective", ("core_attn",), "bf16", 0.0),
    (64, 4, None, "full", ("core_attn", "mlp_act"), "bf16", 0.1),
    (64, 4, None, None, ("core_attn", "mlp_act"), "fp8", 0.0),
    (128, 4, None, "selective", ("core_attn", "mlp_act"), "fp8", 0.0),
]


@pytest.mark.parametrize("h,a,ffn,rc,modules,prec,dropout", CASES)
def test_layer_activation_bytes_match_autograd(h, a, ffn, rc, modules, prec, dropout):
    layout = Layout(micro_batch_size=B, precision=prec, recompute_granularity=rc,
                    recompute_method="uniform" if rc == "full" else None, recompute_modules=modules)
    measured = saved_bytes_per_layer(ParallelState.single(), h, a, ffn, layout, dropout)
    assert _predicted(h, a, ffn, layout, dropout) == measured


@pytest.mark.parametrize("rotary_percent,qk_layernorm,rc", [(1.0, False, None), (0.5, False, "selective"),
                                                           (1.0, True, None)])
def test_rope_activation_bytes_match_autograd(rotary_percent, qk_layernorm, rc):
    """RoPE's rotated queries and keys and its cosines and sines (alone, and after query/key norms)."""
    layout = Layout(micro_batch_size=B, recompute_granularity=rc, attention_backend="unfused")
    options = dict(position_embedding_type="rope", rotary_percent=rotary_percent, rotary_base=500000)
    measured = saved_bytes_per_layer(ParallelState.single(), 64, 4, None, layout, 0.0, **options)
    predicted = _predicted(64, 4, None, layout, 0.0, **options)
    if qk_layernorm:  # the query/key norms' own statistics (not modelled): 2 x 2 bytes per head and position
        options["qk_layernorm"] = True
        measured = saved_bytes_per_layer(ParallelState.single(), 64, 4, None, layout, 0.0, **options)
        predicted = _predicted(64, 4, None, layout, 0.0, **options) + 2 * 2 * 2 * S * B * 4
    assert predicted == measured
    no_rope = saved_bytes_per_layer(ParallelState.single(), 64, 4, None, layout, 0.0,
                                    **{k: v for k, v in options.items() if k == "qk_layernorm"})
    assert measured > no_rope  # the rotation is applied


# ---- Korthikanti et al. 2022 ---------------------------------------------------------------------------------
PS, PH, PA, P_DROP = 32, 64, 4, 0.1  # reduced s, h, a for the paper comparison (b = B); 5as/h = 10
PAPER_CASES = {  # name: (sp, recompute, recompute_modules); TP size from the process group
    "none": (False, None, ()),
    "selective": (False, "selective", ("core_attn",)),
    "selective_with_mlp_act": (False, "selective", ("core_attn", "mlp_act")),
    "full": (False, "full", ()),
    "tp": (False, None, ()),
    "tp_selective": (False, "selective", ("core_attn",)),
    "tp_sp": (True, None, ()),
    "tp_sp_selective": (True, "selective", ("core_attn",)),
    "tp_sp_selective_with_mlp_act": (True, "selective", ("core_attn", "mlp_act")),
    "tp_sp_full": (True, "full", ()),
}


def paper_bytes(recompute, s, b, h, a, t, sp) -> float:
    """Activation bytes per layer of Korthikanti et al. 2022 (Eq. 1-6; 16-bit activations, 1-byte dropout masks)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh  # only the layer input
    attn = 0 if recompute == "selective" else 5 * a * s / h
    if t == 1:
        return sbh * (34 + attn)  # Eq. 1; Eq. 6 (34 sbh) with selective recomputation
    if sp:
        return sbh / t * (34 + attn)  # Eq. 5; Eq. 6 with selective recomputation
    return sbh * (10 + 24 / t + attn / t)  # Eq. 2 (tensor parallelism only)


def named_differences(recompute, modules, s, b, h, a, t, sp, device) -> dict:
    """Every deliberate difference between what this framework keeps (on ``device``, unfused attention and
    bias-dropout-add, dropout on) and the paper, in bytes per layer."""
    sbh, div = s * b * h, (t if sp else 1)
    if recompute == "full":
        return {"full recomputation under SP keeps the layer input's sequence shard, 2sbh/t": -2 * sbh * (1 - 1 / t)
                } if sp else {}
    stat, mask = (2, 2) if device == "cpu" else (4, 1)
    out = {f"LayerNorm mean and rstd, {stat} bytes each (not counted by the paper)": 2 * 2 * stat * s * b / div}
    if mask != 1:
        out[f"hidden-dropout masks of {mask} bytes (PyTorch on the CPU keeps the scaled noise) instead of 1"] = \
            2 * (mask - 1) * sbh / div
        if recompute != "selective":
            out[f"attention-dropout mask of {mask} bytes instead of 1"] = (mask - 1) * a * s * s * b / t
    if recompute == "selective" and "mlp_act" in modules:
        out["GeLU output recomputed (mlp_act), 8sbh/t"] = -8 * sbh / t
    return out


def _paper_layout(name, t):
    sp, rc, modules = PAPER_CASES[name]
    return Layout(tp=t, sp=sp, micro_batch_size=B, attention_backend="unfused", recompute_granularity=rc,
                  recompute_method="uniform" if rc == "full" else None,
                  recompute_modules=modules or ("core_attn", "mlp_act"))


def check_against_paper(pstate, names) -> dict:
    """Measure each case; assert measured == planner (CPU) and measured - named differences == paper within 2%,
    and the planner's CUDA prediction (unfused bias-dropout-add) == paper + its named differences. Returns
    {name: (measured, paper, differences)}."""
    t = pstate.tp_size
    out = {}
    for name in names:
        layout = _paper_layout(name, t)
        rc, modules = layout.recompute_granularity, layout.recompute_modules
        measured = saved_bytes_per_layer(pstate, PH, PA, None, layout, P_DROP, attention_dropout=P_DROP, s=PS)
        assert measured == _predicted(PH, PA, None, layout, P_DROP, P_DROP, PS, "cpu"), (name, t)
        paper = paper_bytes(rc, PS, B, PH, PA, t, layout.sp)
        diffs = named_differences(rc, modules, PS, B, PH, PA, t, layout.sp, "cpu")
        assert abs(measured - sum(diffs.values()) - paper) <= 0.02 * paper, (name, t, measured, paper, diffs)
        unfused_bda = Layout(**{**layout.__dict__, "bias_dropout_fusion": False})
        cuda = _predicted(PH, PA, None, unfused_bda, P_DROP, P_DROP, PS, "cuda")
        cuda_diffs = named_differences(rc, modules, PS, B, PH, PA, t, layout.sp, "cuda")
        assert abs(cuda - sum(cuda_diffs.values()) - paper) <= 0.02 * paper, (name, t, cuda, paper)
        # the fused bias-dropout-add (the CUDA default) keeps no hidden-dropout mask: the paper's 2sbh/t* less
        fused = _predicted(PH, PA, None, layout, P_DROP, P_DROP, PS, "cuda")
        if rc != "full":
            assert cuda - fused == 2 * PS * B * PH / (t if layout.sp else 1), name
        out[name] = (measured, paper, diffs)
    return out


def test_layer_bytes_match_the_paper_without_parallelism():
    check_against_paper(ParallelState.single(), ["none", "selective", "selective_with_mlp_act", "full"])


def _tp_body(rank, world_size):
    for tp in (4, 2):  # TP 4, then TP 2 (x DP 2) in the same 4 processes
        pstate = ParallelState.build(tensor_model_parallel_size=tp)
        check_against_paper(pstate, [n for n in PAPER_CASES if n.startswith("tp")])
        # the SDPA (flash) path with hidden dropout, with and without SP: planner == autograd
        for sp in (False, True):
            for rc in (None, "selective", "full"):
                layout = Layout(tp=tp, sp=sp, micro_batch_size=B, recompute_granularity=rc,
                                recompute_method="uniform" if rc == "full" else None)
                measured = saved_bytes_per_layer(pstate, 64, 4, None, layout, 0.1)
                assert _predicted(64, 4, None, layout, 0.1) == measured, (tp, sp, rc, measured)


def test_layer_bytes_match_the_paper_under_tensor_and_sequence_parallelism():
    """TP 2 and 4 on gloo, unfused attention, dropout on: no SP, SP, SP with selective and full recomputation."""
    run_distributed(_tp_body, world_size=4)


def test_in_flight_microbatches_follow_the_schedule():
    # non-interleaved 1F1B: rank r keeps min(pp - r, m) microbatches
    for pp in (2, 4):
        layout = Layout(pp=pp)
        for r in range(pp):
            for m in (1, 3, 16):
                assert in_flight_peak(layout, r, m, [1.0]) == min(pp - r, m)
    # interleaved (pp 4, 2 chunks): Megatron's count of chunk-microbatches in flight on rank r is
    # min(m * v, 2 * (pp - r - 1) + (v - 1) * pp + 1); with unequal chunk sizes the weights follow the chunks
    layout = Layout(pp=4, vpp=2)
    for r in range(4):
        assert in_flight_peak(layout, r, 8, [1.0, 1.0]) == min(16, 2 * (3 - r) + 4 + 1)
    # pp 2, 2 chunks, 4 microbatches, rank 0 runs F(0,c0) F(1,c0) F(0,c1) F(1,c1) F(2,c0) B(0,c1) F(3,c0) ...:
    # at most four chunk-0 and one chunk-1 microbatches alive at once
    assert in_flight_peak(Layout(pp=2, vpp=2), 0, 4, [10.0, 1.0]) == 4 * 10.0 + 1 * 1.0
    assert in_flight_peak(Layout(), 0, 8, [5.0]) == 5.0


def _bert_head_saved_and_predicted(pstate, sp: bool):
    """(bytes autograd saves in BERT's last stage outside the layers, the planner's kept + loss-buffer bytes)."""
    from megatron.core.models.bert import BertModel
    from megatron.core.models.bert_loss import max_masked_positions
    from megatron.core.planner.memory import chunk_activations
    from megatron.core.planner.shapes import Chunk

    h, a, v, t = 64, 4, 512, pstate.tp_size
    tensor_parallel.model_parallel_seed(1234, pstate)
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=a, seq_length=S, attention_dropout=0.0,
                            hidden_dropout=0.0, params_dtype=torch.bfloat16, padded_vocab_size=v,
                            attention_mask_type="padding", gradient_accumulation_fusion=False, sequence_parallel=sp)
    model = BertModel(cfg, pstate, pre_process=False, post_process=True)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(x):
        st = x.untyped_storage()
        if st.nbytes() and st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return x

    x = torch.randn(S // t if sp else S, B, h, dtype=torch.bfloat16, requires_grad=True)  # the last layer's output
    shape = ModelShape(num_layers=1, hidden_size=h, num_attention_heads=a, seq_length=S, model="bert", vocab_size=v,
                       attention_dropout=0.0, hidden_dropout=0.0, mask_prob=0.2)
    k = shape.lm_positions  # the masked-LM head's static positions per sample
    assert k == max_masked_positions(0.2, S) == 12
    labels = torch.randint(0, v, (B, S))
    loss_mask = torch.zeros(B, S, dtype=torch.long)
    loss_mask[0, torch.randperm(S, generator=torch.Generator().manual_seed(1))[:k]] = 1  # k masked
    loss_mask[1, 3:8] = 1  # fewer: the rest of its slots have weight 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        hidden = model.encoder.final_layernorm(x)
        loss = model._lm_output(model.lm_head(hidden), labels, loss_mask, k)
        binary = model.binary_head(model.pooler(hidden))
    (loss.sum() + binary.float().sum()).backward()
    layout = Layout(tp=t, sp=sp, micro_batch_size=B, cross_entropy_fusion=True)  # BERT: the eager loss regardless
    acts = chunk_activations(shape, layout, Chunk(0, pre=False, post=True), device="cpu")
    fp32_logits = 4 * k * B * v // t
    # the selected rows' logits and their fp32 copy, or half a layer's activations (its gradients) if larger
    half_layer = 0.5 * layer_activation_bytes(shape, layout, "none", "cpu")
    assert acts.transient == max(2 * k * B * v // t + fp32_logits, half_layer)
    return sum(seen.values()), acts.kept + fp32_logits


def test_bert_head_bytes_match_autograd():
    """BERT's last stage outside the layers: final LayerNorm, LM-head transform, the logits of the selected
    positions with the eager loss's fp32 copy, pooler and binary head; the planner's bytes against what autograd
    keeps."""
    saved, predicted = _bert_head_saved_and_predicted(ParallelState.single(), sp=False)
    assert saved == predicted


def _bert_tp_body(rank, world_size):
    pstate = ParallelState.build(tensor_model_parallel_size=world_size)
    for sp in (False, True):
        saved, predicted = _bert_head_saved_and_predicted(pstate, sp)
        assert saved == predicted, (sp, saved, predicted)


def test_bert_head_bytes_under_tensor_and_sequence_parallelism():
    run_distributed(_bert_tp_body, world_size=2)
