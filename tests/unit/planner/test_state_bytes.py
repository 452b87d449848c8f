"""The planner's bytes per rank of parameters, main grads, main params and optimizer state equal the bytes of
the tensors the real model, DDP wrapper and optimizer allocate, on every rank of TP 1/2/4, PP 1/2/4 (uneven
stages, interleaving) and DP 1/2/4, with and without the distributed optimizer (gloo, 4 processes)."""

import torch
import torch.distributed as dist

from megatron.core.distributed import DDPConfig, DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.planner import Layout, ModelShape, state_bytes
from megatron.core.transformer.config import TransformerConfig
from tests.dist_utils import run_distributed

SHAPE = dict(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=301,
             make_vocab_size_divisible_by=8)

# (tp, pp, vpp, first, last, distopt, precision, bucket, untied, optimizer), world size 4
LAYOUTS = [
    (1, 1, None, None, None, False, "bf16", None, False, "adam"),  # DP4
    (1, 1, None, None, None, True, "bf16", None, False, "adam"),
    (1, 1, None, None, None, True, "fp32", 1000, True, "adam"),
    (4, 1, None, None, None, False, "bf16", None, False, "adam"),  # TP4
    (4, 1, None, None, None, True, "fp32", None, False, "sgd"),
    (1, 4, None, None, None, False, "bf16", None, False, "adam"),  # PP4
    (1, 4, None, 3, 1, True, "bf16", None, False, "adam"),  # PP4, uneven stages
    (1, 4, 2, None, None, False, "bf16", None, True, "adam"),  # PP4 interleaved
    (2, 2, None, None, None, False, "bf16", None, False, "adam"),  # TP2 PP2
    (2, 1, None, None, None, True, "bf16", 700, False, "adam"),  # TP2 DP2, buckets
    (1, 2, None, 5, None, True, "bf16", None, True, "adam"),  # PP2 DP2 uneven, untied
    (1, 2, None, None, None, True, "bf16", 500, False, "adam"),  # PP2 DP2, buckets
    (1, 2, None, None, 3, False, "bf16", 600, False, "adam"),  # PP2 DP2 uneven, no distributed optimizer
    (2, 1, None, None, None, False, "fp32", None, True, "sgd"),  # TP2 DP2, no distributed optimizer
]


def _storages(tensors):
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return seen


def _measure(model, optimizer):
    params = _storages(p for c in model for p in c.parameters())
    grads = _storages(b.grad_data for c in model for b in c.buffers)
    stepped = [p for g in optimizer.optimizer.param_groups for p in g["params"]]
    mains = {k: v for k, v in _storages(stepped).items() if k not in params}
    state = _storages(v for s in optimizer.optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    return {"params": sum(params.values()), "main_grads": sum(grads.values()),
            "optimizer_state": sum(state.values()), "main_params": sum(mains.values())}


def _build(pstate, layout, untied):
    dtype = torch.float32 if layout.precision == "fp32" else torch.bfloat16
    shape = ModelShape(share_embeddings_and_output_weights=not untied, **SHAPE)
    cfg = TransformerConfig.from_spec(shape.spec_at(pstate.tp_size), params_dtype=dtype, attention_dropout=0.0,
                                      hidden_dropout=0.0)
    chunks = []
    for v in range(layout.chunks):
        _, count = layers_for_stage(shape.num_layers, pstate.pp_size, pstate.pp_rank, vpp_size=layout.vpp, vpp_rank=v,
                                    first_stage_layers=layout.first_stage_layers,
                                    last_stage_layers=layout.last_stage_layers)
        model = GPTModel(cfg, pstate, pre_process=pstate.pp_rank == 0 and v == 0,
                         post_process=pstate.pp_rank == pstate.pp_size - 1 and v == layout.chunks - 1,
                         num_layers=count)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        chunks.append(model)
    ddp = DDPConfig(use_distributed_optimizer=layout.distributed_optimizer, bucket_size=layout.ddp_bucket_size)
    model = [DistributedDataParallel(c, pstate=pstate, config=ddp) for c in chunks]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=layout.optimizer, bf16=dtype == torch.bfloat16,
                                                 use_distributed_optimizer=layout.distributed_optimizer,
                                                 lr=1e-3), model, pstate)
    # one real step, so the optimizer state exists (torch creates it lazily)
    for c in model:
        for buf in c.buffers:
            buf.grad_data.normal_()
    opt.step()
    return shape, model, opt


def _body(rank, world_size):
    results = []
    for tp, pp, vpp, first, last, distopt, precision, bucket, untied, optimizer in LAYOUTS:
        pstate = ParallelState.build(tp, pp, vpp)
        layout = Layout(tp=tp, pp=pp, dp=world_size // (tp * pp), vpp=vpp, distributed_optimizer=distopt,
                        precision=precision, first_stage_layers=first, last_stage_layers=last,
                        ddp_bucket_size=bucket, optimizer=optimizer)
        shape, model, opt = _build(pstate, layout, untied)
        measured = _measure(model, opt)
        predicted = state_bytes(shape, layout, pp_rank=pstate.pp_rank, dp_rank=pstate.dp_rank)
        predicted.pop("total")
        assert predicted == measured, (layout, pstate.describe(), rank, predicted, measured)
        assert all(v > 0 for k, v in measured.items() if k != "main_params" or precision != "fp32")
        results.append(predicted)
    # the distributed optimizer shrinks the optimizer state per rank (DP4 rows 0 and 1)
    assert results[1]["optimizer_state"] < results[0]["optimizer_state"]
    dist.barrier()


def test_state_bytes_match_real_allocations_on_every_rank():
    run_distributed(_body, world_size=4)
