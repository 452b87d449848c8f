"""The planner's activation bytes per layer equal what autograd really keeps, and its in-flight microbatch
counts follow the 1F1B / interleaved schedules."""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.parallel_state import ParallelState
from megatron.core.planner import Layout, ModelShape
from megatron.core.planner.memory import in_flight_peak, layer_activation_bytes
from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import TransformerConfig
from tests.dist_utils import run_distributed

S, B = 64, 2


def saved_bytes_per_layer(pstate, h, a, ffn, layout: Layout, dropout: float, layers: int = 2) -> float:
    """Bytes of the distinct storages autograd saves in one forward pass of a block, parameters excluded."""
    tensor_parallel.model_parallel_seed(1234, pstate)
    mode = layout.recompute_granularity
    cfg = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=a, ffn_hidden_size=ffn,
                            seq_length=S, attention_dropout=0.0, hidden_dropout=dropout,
                            params_dtype=torch.bfloat16, sequence_parallel=layout.sp,
                            recompute_granularity=mode, recompute_method="uniform" if mode == "full" else None,
                            recompute_num_layers=1 if mode == "full" else None,
                            recompute_modules=layout.recompute_modules,
                            fp8="hybrid" if layout.precision == "fp8" else None)
    block = TransformerBlock(cfg, pstate, layers, post_layer_norm=False)
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

    x = torch.randn(S // pstate.tp_size if layout.sp else S, B, h, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    out.float().sum().backward()
    return sum(seen.values()) / layers


def _predicted(h, a, ffn, layout, dropout):
    shape = ModelShape(num_layers=2, hidden_size=h, num_attention_heads=a, ffn_hidden_size=ffn, seq_length=S,
                       attention_dropout=0.0, hidden_dropout=dropout)
    mode = {None: "none"}.get(layout.recompute_granularity, layout.recompute_granularity)
    return layer_activation_bytes(shape, layout, mode)


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


def _tp_body(rank, world_size):
    pstate = ParallelState.build(tensor_model_parallel_size=world_size)
    for sp in (False, True):
        for rc in (None, "selective", "full"):
            layout = Layout(tp=world_size, sp=sp, micro_batch_size=B, recompute_granularity=rc,
                            recompute_method="uniform" if rc == "full" else None)
            measured = saved_bytes_per_layer(pstate, 64, 4, None, layout, 0.1)
            assert _predicted(64, 4, None, layout, 0.1) == measured, (sp, rc, measured)


def test_layer_activation_bytes_under_tensor_and_sequence_parallelism():
    run_distributed(_tp_body, world_size=2)


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
    acts = chunk_activations(shape, layout, Chunk(0, pre=False, post=True))
    fp32_logits = 4 * k * B * v // t
    # the selected rows' logits and their fp32 copy, or half a layer's activations (its gradients) if larger
    assert acts.transient == max(2 * k * B * v // t + fp32_logits, 0.5 * layer_activation_bytes(shape, layout, "none"))
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
