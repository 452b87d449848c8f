"""BERT under TP (± SP), PP (1F1B and interleaved) and TP×PP against one process: same seed, same full weights,
so the per-microbatch ``lm loss`` / ``sop loss`` and every gradient must agree (fp32, dropout off). The layouts
project only a static number of positions per sample onto the vocabulary; the reference projects every position.

Each layout runs the real pipeline schedules with the BERT forward step and loss, and ``finalize_model_grads``
(sequence-parallel and tied-embedding sums); the reference is the unsharded model run without pipelining.
"""

import torch

from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.bert import BertModel, global_bert_parameter_name, initialize_bert_parameters
from megatron.core.models.bert_loss import make_bert_forward_step
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.core.transformer.config import TransformerConfig
from tests.dist_utils import run_distributed

SEQ, MBS, H, LAYERS, VOCAB, MICROBATCHES = 8, 2, 32, 4, 64, 4


def _config(sp=False, post_ln=False):
    return TransformerConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=4, seq_length=SEQ,
                             padded_vocab_size=VOCAB, attention_dropout=0.0, hidden_dropout=0.0, sequence_parallel=sp,
                             attention_mask_type="padding", apply_residual_connection_post_layernorm=post_ln)


def _batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(MICROBATCHES):
        text = torch.randint(0, VOCAB - 4, (MBS, SEQ), generator=g)
        lengths = torch.randint(4, SEQ + 1, (MBS,), generator=g)
        padding = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [b, s], 1 = token
        loss_mask = (torch.rand(MBS, SEQ, generator=g) < 0.4).long() * padding
        loss_mask[:, 1] = 1  # at least one masked position per sample
        labels = torch.where(loss_mask.bool(), torch.randint(0, VOCAB - 4, (MBS, SEQ), generator=g), -1)
        types = (torch.arange(SEQ).unsqueeze(0) >= (lengths // 2).unsqueeze(1)).long() * padding
        out.append(dict(text=text, types=types, labels=labels, is_random=torch.randint(0, 2, (MBS,), generator=g),
                        loss_mask=loss_mask, padding_mask=padding))
    return out


def _max_masked() -> int:
    """The static number of projected positions: the most any sample masks (others fill slots with weight 0)."""
    k = max(int(b["loss_mask"].sum(1).max()) for b in _batches())
    assert k < SEQ
    return k


def _reference(cfg):
    """The unsharded model projecting every position (the full-vocabulary loss weighted by the loss mask)."""
    single = ParallelState.single()
    model = BertModel(cfg, single)
    initialize_bert_parameters(model, 21, cfg, single)
    stats = forward_backward_no_pipelining(make_bert_forward_step(single), iter(_batches()), model, MICROBATCHES,
                                           SEQ, MBS, H, torch.float32, single)
    return stats, {n: p.grad for n, p in model.named_parameters()}


def _layout(pstate, sp=False, post_ln=False):
    cfg_ref, cfg = _config(False, post_ln), _config(sp, post_ln)
    ref_stats, ref_grads = _reference(cfg_ref)
    vpp = pstate.vpp_size or 1
    chunks = []
    for v in range(vpp):
        offset, count = layers_for_stage(LAYERS, pstate.pp_size, pstate.pp_rank, vpp_size=pstate.vpp_size, vpp_rank=v)
        pre = pstate.is_pipeline_first_stage and v == 0
        post = pstate.is_pipeline_last_stage and v == vpp - 1
        model = BertModel(cfg, pstate, pre_process=pre, post_process=post, num_layers=count, layer_offset=offset)
        initialize_bert_parameters(model, 21, cfg, pstate, layer_offset=offset)
        chunks.append(model)
    fb = get_forward_backward_func(pstate)
    batches = _batches()
    step = make_bert_forward_step(pstate, max_masked=_max_masked())  # the static selection of the masked positions
    stats = fb(step, [iter(batches) for _ in chunks], chunks if vpp > 1 else chunks[0],
               MICROBATCHES, SEQ, MBS, H, torch.float32, pstate, sequence_parallel=sp,
               finalize_grads_func=lambda c: finalize_model_grads(c, pstate))
    where = f"tp{pstate.tp_size} pp{pstate.pp_size} vpp{vpp} sp={sp} post_ln={post_ln}"
    if pstate.is_pipeline_last_stage:
        assert len(stats) == MICROBATCHES and set(stats[0]) == {"lm loss", "sop loss"}, where
        for got, ref in zip(stats, ref_stats):
            for key in ("lm loss", "sop loss"):
                torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-6, msg=f"{key} {where}")
    checked = 0
    for model in chunks:
        for name, p in model.named_parameters():
            ref = ref_grads[global_bert_parameter_name(name, model.layer_offset, True)]
            if getattr(p, "tensor_model_parallel", False):
                ref = ref.chunk(pstate.tp_size, dim=p.partition_dim)[pstate.tp_rank]
            torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-6, msg=f"grad of {name} ({where})")
            checked += 1
    assert checked > 0


def _two_ranks(rank, world):
    tp2 = ParallelState.build(tensor_model_parallel_size=2)
    model_parallel_seed(5, tp2)
    _layout(tp2)
    _layout(tp2, sp=True)
    _layout(tp2, sp=True, post_ln=True)
    pp2 = ParallelState.build(pipeline_model_parallel_size=2)
    model_parallel_seed(5, pp2)
    _layout(pp2)
    _layout(pp2, post_ln=True)
    vpp2 = ParallelState.build(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    _layout(vpp2)


def test_bert_tp2_sp_pp2_interleaved_match_one_process():
    run_distributed(_two_ranks, 2)


def _four_ranks(rank, world):
    ps = ParallelState.build(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model_parallel_seed(5, ps)
    _layout(ps, sp=True)


def test_bert_tp2_pp2_sequence_parallel_matches_one_process():
    run_distributed(_four_ranks, 4)
