"""FusedAdamW (megatron/core/optimizer/fused_adamw.py) against torch's AdamW.

Same hyperparameters, same grads, several steps: the fp32 params and moments must agree within fp32 rounding,
the 16-bit model copies must equal the params cast by PyTorch, a skipped step (``found_inf``) must change
nothing, ``grad_scale`` must divide the grads, and state dicts must move between the two optimizers. On the CPU
(CI) this checks the optimizer's own logic with its PyTorch-ops update against torch's foreach AdamW; on CUDA
the Triton kernel against torch's fused AdamW, plus a CUDA-graph-captured step and views at unaligned offsets.
The trainer uses it by default on CUDA (tests/gpu/test_fused_training.py, test_cuda_graph.py); ``--no-fused-adamw``
selects torch's.
"""

import io

import pytest
import torch

from megatron.core.optimizer.fused_adamw import FusedAdamW

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
SHAPES = [(37, 5), (3000,), (2048,), (1,), (129, 257)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _params(device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device=device, generator=g)) for s in SHAPES]


def _groups(params):
    return [{"params": params[:2] + params[4:], "weight_decay": 0.1}, {"params": params[2:4], "weight_decay": 0.0}]


def _torch_adamw(groups, device):
    return torch.optim.AdamW(groups, **HYPER, **({"fused": True} if device == "cuda" else {"foreach": True}))


def _pair(device, dtype=torch.bfloat16):
    ref, ours = _params(device), _params(device)
    torch_opt = _torch_adamw(_groups(ref), device)
    fused = FusedAdamW(_groups(ours), **HYPER)
    copies = [torch.empty(p.shape, dtype=dtype, device=device) for p in ours]
    fused.set_model_params(zip(ours, copies))
    return ref, ours, torch_opt, fused, copies


def _set_grads(params_lists, step, scale=1.0):
    device = params_lists[0][0].device
    g = torch.Generator(device=device).manual_seed(100 + step)
    grads = [torch.randn(s, device=device, generator=g) for s in SHAPES]
    for params in params_lists:
        for p, gr in zip(params, grads):
            p.grad = gr * scale


def _assert_close(ref, ours):
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_torch_adamw(device, dtype):
    ref, ours, torch_opt, fused, copies = _pair(device, dtype)
    for step in range(6):
        _set_grads([ref, ours], step)
        torch_opt.step()
        fused.step()
        _assert_close(ref, ours)
        for p, c in zip(ours, copies):
            assert torch.equal(c, p.detach().to(dtype))
    for a, b in zip(ref, ours):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[b][key], torch_opt.state[a][key], rtol=1e-5, atol=1e-7)
        assert float(fused.state[b]["step"]) == float(torch_opt.state[a]["step"]) == 6


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scale_and_found_inf(device):
    ref, ours, torch_opt, fused, copies = _pair(device)
    _set_grads([ref, ours], 0)
    torch_opt.step()
    fused.step()
    before = [p.detach().clone() for p in ours]
    copies_before = [c.clone() for c in copies]
    _set_grads([ours], 1)
    fused.grad_scale = torch.tensor(4.0, device=device)
    fused.found_inf = torch.tensor(1.0, device=device)
    fused.step()  # skipped: nothing moves, the step count stays
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, ours))
    assert all(torch.equal(a, b) for a, b in zip(copies_before, copies))
    assert float(fused.state[ours[0]]["step"]) == 1
    fused.found_inf = torch.tensor(0.0, device=device)
    _set_grads([ref], 1, scale=0.25)  # torch gets the grads already divided by 4
    torch_opt.step()
    fused.step()
    del fused.grad_scale, fused.found_inf
    _assert_close(ref, ours)


@CUDA
def test_captured_step_equals_eager():
    eager_p, graph_p = _params("cuda"), _params("cuda")
    eager = FusedAdamW(_groups(eager_p), **HYPER)
    graph = FusedAdamW(_groups(graph_p), capturable=True, **HYPER)
    copies = [torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for p in graph_p]
    graph.set_model_params(zip(graph_p, copies))
    lrs = [torch.tensor(1e-2, device="cuda") for _ in graph.param_groups]
    _set_grads([eager_p, graph_p], 0)
    eager.step()
    graph.step()  # the first step (eager) builds the state and the launch tables
    static = [p.grad for p in graph_p]
    floats = [grp["lr"] for grp in graph.param_groups]
    for grp, t in zip(graph.param_groups, lrs):
        grp["lr"] = t
    cuda_graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(cuda_graph):
        graph.step()
    for grp, v in zip(graph.param_groups, floats):
        grp["lr"] = v
    # capturing ran nothing; now replay with new grads and a new learning rate per step
    for step in range(1, 4):
        lr = 1e-2 / step
        for grp in eager.param_groups:
            grp["lr"] = lr
        for t in lrs:
            t.fill_(lr)
        _set_grads([eager_p], step)
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        for buf, s in zip(static, SHAPES):
            buf.copy_(torch.randn(s, device="cuda", generator=g))
        eager.step()
        cuda_graph.replay()
    torch.cuda.synchronize()
    _assert_close(eager_p, graph_p)
    for p, c in zip(graph_p, copies):
        assert torch.equal(c, p.detach().to(torch.bfloat16))


def _through_a_file(state_dict):
    """A checkpoint round trip: without it the loading optimizer would share the saver's moment tensors."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_moves_between_torch_and_fused(device):
    ref, ours, torch_opt, fused, _ = _pair(device)
    for step in range(3):
        _set_grads([ref, ours], step)
        torch_opt.step()
        fused.step()
    # fused -> torch: each param gets its own step tensor, so torch's AdamW counts each once
    p_torch = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    t2 = _torch_adamw(_groups(p_torch), device)
    t2.load_state_dict(_through_a_file(fused.state_dict()))
    # torch -> fused
    p_fused = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    f2 = FusedAdamW(_groups(p_fused), **HYPER)
    f2.load_state_dict(_through_a_file(torch_opt.state_dict()))
    for step in range(3, 6):
        _set_grads([ref, ours, p_torch, p_fused], step)
        for opt in (torch_opt, fused, t2, f2):
            opt.step()
    _assert_close(ref, p_torch)
    _assert_close(ref, p_fused)
    _assert_close(ref, ours)
    assert all(float(t2.state[p]["step"]) == 6 for p in p_torch)


@CUDA
def test_views_at_unaligned_offsets():
    """Params and grads that are views into flat buffers at offsets not 16-byte aligned take the masked launch;
    the aligned ones the vector one; both must equal torch's update."""
    spans = [(1, 38), (40, 3040), (3040, 7136), (7137, 7140)]
    g = torch.Generator(device="cuda").manual_seed(5)
    values = torch.randn(7200, device="cuda", generator=g)
    ref = [torch.nn.Parameter(values[a:b].clone()) for a, b in spans]
    flat, flat_grad = values.clone(), torch.zeros_like(values)
    ours = [torch.nn.Parameter(flat[a:b]) for a, b in spans]
    copies_flat = torch.zeros(7200, dtype=torch.bfloat16, device="cuda")
    torch_opt = torch.optim.AdamW(ref, fused=True, weight_decay=0.1, **HYPER)
    fused = FusedAdamW(ours, weight_decay=0.1, **HYPER)
    fused.set_model_params(zip(ours, [copies_flat[a:b] for a, b in spans]))
    for step in range(3):
        grads = [torch.randn(b - a, device="cuda", generator=g) for a, b in spans]
        for p, gr, (a, b) in zip(ref, grads, spans):
            p.grad = gr.clone()
        for p, gr, (a, b) in zip(ours, grads, spans):
            flat_grad[a:b] = gr
            p.grad = flat_grad[a:b]
        torch_opt.step()
        fused.step()
        _assert_close(ref, ours)
    assert sorted(launch.aligned for launch in fused._plans[0].launches) == [False, True]
    for p, (a, b) in zip(ours, spans):
        assert torch.equal(copies_flat[a:b], p.detach().to(torch.bfloat16))


def test_mixed_precision_optimizer_lets_it_write_the_model_params():
    """Inside MixedPrecisionOptimizer the update writes the bf16 model params itself (no separate copy), and the
    steps equal those of the same wrapper around torch's AdamW."""
    from megatron.core.distributed import DDPConfig, DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.factory import build_param_groups
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
    from megatron.core.parallel_state import ParallelState
    from tests.unit.distributed.dp_tiny import make_model

    single = ParallelState.single()
    cfg = OptimizerConfig(bf16=True, lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    runs = []
    for make in (lambda gs: FusedAdamW(gs, lr=cfg.lr, weight_decay=cfg.weight_decay),
                 lambda gs: torch.optim.AdamW(gs, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(make_model(dtype=torch.bfloat16), pstate=single, config=DDPConfig())
        opt = MixedPrecisionOptimizer(cfg, make, build_param_groups([ddp], cfg), [ddp], single)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            for p in ddp.parameters():
                p.main_grad.copy_(torch.randn(p.shape, generator=g))
            assert opt.step()[0]
        runs.append((opt, [p.detach().clone() for p in ddp.parameters()]))
    (fused_opt, fused_params), (torch_opt, torch_params) = runs
    assert fused_opt.optimizer.writes_model_params and not isinstance(torch_opt.optimizer, FusedAdamW)
    for p, m in zip(fused_opt.model_params, fused_opt.main_params):
        assert torch.equal(p, m.detach().bfloat16())  # written by the update
    with torch.no_grad():
        fused_opt.model_params[0].zero_()
    fused_opt._copy_main_params_to_model()  # the wrapper's own copy pass is off
    assert not fused_opt.model_params[0].any()
    _assert_close(torch_opt.main_params, fused_opt.main_params)
    for a, b in zip(torch_params, fused_params):
        assert (a.float() - b.float()).abs().max() <= 2 ** -7 * a.float().abs().max()  # at most a bf16 rounding
