"""DP=2 and DP=4 training (gloo) matches a single-process run on the same global batch.

Variants: plain all-reduce, overlapped bucketed all-reduce, the distributed optimizer, and the distributed
optimizer with overlapped buckets and overlapped param all-gather. Also checks that no collective is launched
under ``no_sync``, that overlap launches every bucket during the last backward, and that the distributed
optimizer's state summed over DP ranks equals the replicated optimizer's; at DP=2 also the no_sync
accumulation and the DP mean of ``finish_grad_sync``.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DDPConfig, DistributedDataParallel
from megatron.core.distributed.grad_buffer import PARAM_ALIGN, align_up
from megatron.core.grad_record import add_grad, record_of
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, optimizer_memory_report
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed
from tests.unit.distributed.dp_tiny import dp_train, make_model, reference_run

STEPS = 4
VARIANTS = {
    "allreduce": (dict(), dict()),
    "overlap_small_buckets": (dict(overlap_grad_reduce=True, bucket_size=100), dict()),
    "distopt": (dict(use_distributed_optimizer=True), dict(use_distributed_optimizer=True)),
    "distopt_overlap": (dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=100),
                        dict(use_distributed_optimizer=True, overlap_param_gather=True)),
}


def _overlap_checker(overlap: bool):
    def check(ddp, phase):
        handles = [b.grad_handle for b in ddp.buckets()]
        if phase == "accumulated":  # only no_sync microbatches so far: nothing may have been launched
            assert all(h is None for h in handles)
        elif overlap:  # every bucket's grads were final during the last backward: all launched
            assert len(handles) > 1 and all(h is not None for h in handles)
        else:
            assert all(h is None for h in handles)
    return check


def _body(rank, world):
    pstate = ParallelState.build(1, 1)
    assert pstate.dp_size == world
    ref_model, _, ref_norms = reference_run(STEPS)
    state_bytes = {}
    for name, (ddp_kw, opt_kw) in VARIANTS.items():
        ddp = DistributedDataParallel(make_model(), pstate=pstate, config=DDPConfig(**ddp_kw))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, **opt_kw), [ddp], pstate)
        norms = dp_train(ddp, opt, pstate, STEPS, microbatches=2,
                         check_overlap=_overlap_checker(ddp_kw.get("overlap_grad_reduce", False)))
        ddp.finish_param_sync()
        for n, r in zip(norms, ref_norms):
            assert abs(n - r) <= 1e-6 * max(1.0, abs(r)), (name, norms, ref_norms)
        for (pname, p), (_, q) in zip(ddp.named_parameters(), ref_model.named_parameters()):
            err = (p - q).abs().max().item()
            assert err < 2e-6, (name, pname, err)
        # no prefix: checkpoint keys are the inner module's
        assert list(ddp.state_dict().keys()) == list(ref_model.state_dict().keys())
        state_bytes[name] = optimizer_memory_report(opt, [ddp])["optimizer_state"]
    # the shards of the distributed optimizer's state add up to exactly one replica's state
    total = torch.tensor([state_bytes["distopt"]], dtype=torch.float64)
    dist.all_reduce(total)
    assert int(total.item()) == state_bytes["allreduce"]
    assert state_bytes["distopt"] < state_bytes["allreduce"]
    if world == 2:
        _no_sync_body(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_dp_matches_single_process(world):
    run_distributed(_body, world)


def _no_sync_body(rank, world):
    """Under no_sync grads stay local; finish_grad_sync then yields the DP mean of the accumulated grads."""
    pstate = ParallelState.build(1, 1)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 3), pstate=pstate,
                                  config=DDPConfig(overlap_grad_reduce=True, bucket_size=5))
    with ddp.no_sync():
        for _ in range(2):  # two local microbatches, scaled by (rank + 1)
            ddp(torch.ones(2, 4)).sum().mul(rank + 1).backward()
    assert all(b.grad_handle is None for b in ddp.buckets())
    assert ddp.module.weight.grad is None  # moved into main_grad
    torch.testing.assert_close(ddp.module.weight.main_grad, torch.full((3, 4), 4.0 * (rank + 1)))
    ddp.finish_grad_sync()
    mean = 4.0 * sum(r + 1 for r in range(world)) / world
    torch.testing.assert_close(ddp.module.weight.main_grad, torch.full((3, 4), mean))
    torch.testing.assert_close(ddp.module.bias.main_grad, torch.full((3,), mean))
    ddp.zero_grad_buffer()  # clears the buffer and marks every main grad zero
    assert all(record_of(p).is_zero for p in ddp.parameters())
    assert ddp.module.weight.main_grad.abs().sum() == 0 and ddp.module.bias.main_grad.abs().sum() == 0


def test_bucket_layout_single_process():
    """Reverse order, buckets of at least bucket_size elements, every range starting at a multiple of PARAM_ALIGN
    elements, padding to 128*DP under the distributed optimizer."""
    model = make_model()
    ddp = DistributedDataParallel(model, pstate=ParallelState.single(), config=DDPConfig(bucket_size=300))
    buf = ddp.buffers[0]
    assert buf.params[0] is model.head.bias and buf.params[-1] is model.fc1.weight
    assert all(b.numel >= 300 for b in buf.buckets[:-1])
    aligned = sum(align_up(p.numel(), PARAM_ALIGN) for p in model.parameters())
    assert sum(b.numel for b in buf.buckets) == aligned > sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        assert p.main_grad.shape == p.shape and p.main_grad.data_ptr() >= buf.grad_data.data_ptr()
        assert buf.index[p][0] % PARAM_ALIGN == 0
    sharded = DistributedDataParallel(make_model(), pstate=ParallelState.single(),
                                      config=DDPConfig(bucket_size=300, use_distributed_optimizer=True))
    assert all(b.numel % 128 == 0 for b in sharded.buffers[0].buckets)
    with pytest.raises(ValueError, match="--ddp-bucket-size"):
        DDPConfig(bucket_size=0)


class _FusedWgradLinear(torch.autograd.Function):
    """y = x W^T whose weight grad is stored straight into ``W.main_grad`` (no ``W.grad``) through the gradient
    record, like gradient-accumulation fusion."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        add_grad(weight, dy.t() @ x)
        return dy @ weight, None


def test_overlap_with_grads_written_into_main_grad():
    """The post-accumulate hook still fires for a weight whose grad went straight into main_grad, so its
    bucket launches during backward and the value is not added twice."""
    lin = torch.nn.Linear(4, 3, bias=False)
    ref = lin.weight.detach().clone().requires_grad_()
    ddp = DistributedDataParallel(torch.nn.ModuleList([lin]), pstate=ParallelState.single(),
                                  config=DDPConfig(overlap_grad_reduce=True))
    x = torch.randn(5, 4)
    _FusedWgradLinear.apply(x, lin.weight).pow(2).sum().backward()
    assert all(b.grad_handle is not None for b in ddp.buckets())  # launched inside backward
    ddp.finish_grad_sync()
    (x @ ref.t()).pow(2).sum().backward()
    torch.testing.assert_close(lin.weight.main_grad, ref.grad)
    assert lin.weight.grad is None
