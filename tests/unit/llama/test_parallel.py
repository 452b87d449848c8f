"""A Llama-option GPT (grouped-query attention with per-head query/key norms, RoPE with Llama 3.1 scaling, RMSNorm,
SwiGLU, no biases, untied output layer) under TP 2/4 ± SP (TP below and equal to the number of query groups),
PP 2, DP 2 and TP2×PP2 against one process: the same seed gives the same full weights at every layout, and the
per-microbatch loss and every gradient agree (fp32, dropout 0).

Each layout runs the real pipeline schedules with ``pretrain_gpt.py``'s batch and loss functions, the
data-parallel wrapper (each DP rank on its own microbatches) and ``finalize_model_grads``; the reference is the
unsharded model run without pipelining over every DP rank's microbatches. The checkpoint resharding of the same
model (TP1 -> TP2 -> TP1 through ``reshard.py``) keeps its logits.
"""


import torch

from megatron.core.checkpoint_formats.layout import GPT, ModelDims
from megatron.core.checkpoint_formats.reshard import merge_tp_pp, split_tp_pp
from megatron.core.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.init import global_parameter_name
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_seed
from pretrain_gpt import get_batch, loss_func
from tests.dist_utils import run_distributed
from tests.unit.llama.helpers import PADDED_VOCAB, VOCAB, batch, built, llama_config, with_options

SEQ, MBS, MICROBATCHES, SEED = 8, 2, 2, 11
CONFIG = llama_config(num_layers=2, num_attention_heads=8, num_query_groups=4, hidden_size=64, ffn_hidden_size=96,
                      seq_length=SEQ, max_position_embeddings=SEQ, qk_layernorm=True)


def _batches(count: int):
    g = torch.Generator().manual_seed(3)
    return [{"text": torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)} for _ in range(count)]


def _step(pstate):
    def forward_step(data_iterator, model):
        inner = getattr(model, "module", model)
        needs = inner.pre_process or inner.post_process
        tokens, labels, loss_mask, positions = get_batch(data_iterator, pstate, None, needs)
        out = model(tokens, positions, labels=labels if inner.post_process else None)
        return out, lambda output: loss_func(loss_mask, output)

    return forward_step


def _reference(dp: int):
    single = ParallelState.single()
    model = built(CONFIG, single, seed=SEED)
    stats = forward_backward_no_pipelining(_step(single), iter(_batches(dp * MICROBATCHES)), model,
                                           dp * MICROBATCHES, SEQ, MBS, CONFIG.hidden_size, torch.float32, single)
    return stats, model


def _layout(pstate, sp: bool):
    cfg = with_options(CONFIG, sequence_parallel=sp)
    ref_stats, ref_model = _reference(pstate.dp_size)
    ref_params = dict(ref_model.named_parameters())
    chunks = []
    offset, count = layers_for_stage(cfg.num_layers, pstate.pp_size, pstate.pp_rank)
    model = built(cfg, pstate, seed=SEED, pre_process=pstate.is_pipeline_first_stage,
                  post_process=pstate.is_pipeline_last_stage, num_layers=count, layer_offset=offset)
    where = f"tp{pstate.tp_size} pp{pstate.pp_size} dp{pstate.dp_size} sp={sp}"
    full_names = {}
    for name, p in model.named_parameters():  # the same full weights at every layout
        full_names[name] = global_parameter_name(name, offset, cfg.share_embeddings_and_output_weights)
        want = ref_params[full_names[name]].detach()
        if getattr(p, "tp_sharding", None) is not None:
            want = p.tp_sharding.shard(want, pstate.tp_size, pstate.tp_rank)
        assert torch.equal(p.detach(), want), f"initial {name} ({where})"
    chunks.append(DistributedDataParallel(model, pstate=pstate, config=DDPConfig()))
    mine = _batches(pstate.dp_size * MICROBATCHES)[pstate.dp_rank * MICROBATCHES:(pstate.dp_rank + 1) * MICROBATCHES]
    stats = get_forward_backward_func(pstate)(
        _step(pstate), iter(mine), chunks[0], MICROBATCHES, SEQ, MBS, cfg.hidden_size, torch.float32, pstate,
        sequence_parallel=sp, finalize_grads_func=lambda c: finalize_model_grads(c, pstate))
    if pstate.is_pipeline_last_stage:
        expected = ref_stats[pstate.dp_rank * MICROBATCHES:(pstate.dp_rank + 1) * MICROBATCHES]
        for got, ref in zip(stats, expected, strict=True):
            torch.testing.assert_close(got["lm loss"], ref["lm loss"], rtol=1e-5, atol=1e-6, msg=where)
    for name, p in model.named_parameters():
        ref = ref_params[full_names[name]].grad
        if getattr(p, "tp_sharding", None) is not None:
            ref = p.tp_sharding.shard(ref, pstate.tp_size, pstate.tp_rank)
        torch.testing.assert_close(p.main_grad, ref, rtol=1e-4, atol=1e-6, msg=f"grad of {name} ({where})")


def _four_ranks(rank, world):
    for tp, pp, sp in ((2, 1, False), (2, 1, True), (4, 1, True), (4, 1, False), (2, 2, True)):
        ps = ParallelState.build(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_seed(5, ps)
        _layout(ps, sp)


def test_llama_options_tp_sp_pp_dp_match_one_process():
    run_distributed(_four_ranks, 4)


def _dims(cfg) -> ModelDims:
    return ModelDims(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                     num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
                     max_position_embeddings=cfg.max_position_embeddings, padded_vocab_size=PADDED_VOCAB,
                     vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                     tied_embeddings=cfg.share_embeddings_and_output_weights,
                     num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
                     gated_linear_unit=cfg.gated_linear_unit)


def _reshard(rank, world):
    """TP1 -> TP2 (the split state loaded into TP2 models) -> TP1 keeps the logits and every weight."""
    ps = ParallelState.build(tensor_model_parallel_size=2)
    single = ParallelState.single()
    ids, pos, _ = batch(s=SEQ)
    for options in (dict(), dict(num_query_groups=2, add_qkv_bias=True), dict(num_query_groups=1)):
        cfg = with_options(CONFIG, **options)
        one = built(cfg, single, seed=SEED + 1).eval()
        dims = _dims(cfg)
        two_states = split_tp_pp(dict(one.state_dict()), dims, tp=2, pp=1) if cfg.num_query_groups % 2 == 0 else None
        if two_states is None:  # multi-query attention cannot split its one group
            try:
                split_tp_pp(dict(one.state_dict()), dims, tp=2, pp=1)
            except Exception as exc:  # noqa: BLE001 - the message is what is checked
                assert "--target-tensor-parallel-size 2" in str(exc) and "units" in str(exc), exc
            else:
                raise AssertionError("a single query group was split over two ranks")
            continue
        two = GPTModel(cfg, ps).eval()
        two.load_state_dict(two_states[(ps.tp_rank, 0)][0], strict=True)
        with torch.no_grad():
            want = one(ids, pos)
            got = two(ids, pos)  # [b, s, V/2]
        gathered = [torch.empty_like(got) for _ in range(2)]
        torch.distributed.all_gather(gathered, got, group=ps.tp_group)
        torch.testing.assert_close(torch.cat(gathered, -1), want, rtol=1e-5, atol=1e-5)
        shards = [None, None]
        torch.distributed.all_gather_object(shards, {k: v for k, v in two.state_dict().items()}, group=ps.tp_group)
        back = merge_tp_pp({(t, 0): [shards[t]] for t in range(2)}, GPT, tied=False, dims=dims)
        for name, value in one.state_dict().items():
            assert torch.equal(back[name], value), name
        again = GPTModel(cfg, single).eval()
        again.load_state_dict(back, strict=True)
        with torch.no_grad():
            torch.testing.assert_close(again(ids, pos), want, rtol=0, atol=0)


def test_reshard_tp1_tp2_tp1_keeps_logits():
    run_distributed(_reshard, 2)
