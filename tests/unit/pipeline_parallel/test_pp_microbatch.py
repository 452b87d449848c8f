"""Output deallocation, custom backward, tensor shapes and the timeline renderer (single process)."""

import pytest
import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.microbatch import custom_backward, deallocate_output, first_and_last_stage
from megatron.core.pipeline_parallel.p2p import P2PCommunicator, pipeline_tensor_shape
from megatron.core.pipeline_parallel.timeline import main, render_timeline


@pytest.mark.parametrize("last_op", ["residual", "tanh"])
def test_deallocated_output_still_backpropagates(last_op):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 2, 8, requires_grad=True)  # [s, b, h]
    grad = torch.randn(4, 2, 8)

    def run():
        h = lin(x)
        return h + x if last_op == "residual" else torch.tanh(h)

    torch.autograd.backward(run(), grad)
    ref = [t.grad.clone() for t in (x, lin.weight, lin.bias)]
    for t in (x, lin.weight, lin.bias):
        t.grad = None
    out = run()
    deallocate_output(out)
    assert out.numel() == 1  # storage released from the tensor the schedule holds
    custom_backward(out, grad)
    for got, want in zip((x.grad, lin.weight.grad, lin.bias.grad), ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_views_and_leaves_are_not_freed():
    base = torch.randn(4, 8, requires_grad=True)
    view = (base * 2)[:2]
    deallocate_output(view)
    deallocate_output(base)
    assert view.shape == (2, 8) and base.shape == (4, 8)


def test_stage_roles():
    assert first_and_last_stage(4, 0, 0, 1) == (True, False)
    assert first_and_last_stage(4, 3, 0, 1) == (False, True)
    assert first_and_last_stage(2, 1, 0, 2) == (False, False)  # stage 1 of 4
    assert first_and_last_stage(2, 1, 1, 2) == (False, True)  # stage 3 of 4


def test_pipeline_tensor_shape():
    assert pipeline_tensor_shape(32, 2, 16) == (32, 2, 16)
    assert pipeline_tensor_shape(32, 2, 16, tp_size=4, sequence_parallel=True) == (8, 2, 16)
    assert pipeline_tensor_shape(32, 2, 16, tp_size=4, sequence_parallel=False) == (32, 2, 16)
    with pytest.raises(ValueError, match=r"--seq-length \(30\) divisible by --tensor-model-parallel-size \(4\)"):
        pipeline_tensor_shape(30, 2, 16, tp_size=4, sequence_parallel=True)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        pipeline_tensor_shape(32, 0, 16)


def test_communicator_needs_process_group_and_checks_shapes():
    pstate = ParallelState(pp_size=2)
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        P2PCommunicator(pstate, (4, 2, 8), torch.float32)
    comm = P2PCommunicator(ParallelState.single(), (4, 2, 8), torch.float32)
    with pytest.raises(RuntimeError, match=r"shape \[4, 2, 8\] and dtype torch.float32.*got shape \[4, 2, 4\]"):
        comm.check(torch.zeros(4, 2, 4), "send to rank 1")
    with pytest.raises(RuntimeError, match="dtype torch.bfloat16"):
        comm.check(torch.zeros(4, 2, 8, dtype=torch.bfloat16), "send to rank 1")


def test_timeline_render(capsys):
    text = render_timeline(4, 8)
    rows = [line for line in text.splitlines() if line.startswith("rank")]
    assert len(rows) == 4
    assert rows[0].split()[2:6] == ["F0", "F1", "F2", "F3"]  # rank 0 warms up with pp - 1 = 3 forwards, then F3
    assert rows[3].split()[2:6] == [".", ".", ".", "F0"]
    assert "bubble 6 ticks" in text  # (pp - 1) * (F + B) with unit-time F and B
    inter = render_timeline(4, 8, 2)
    assert "bubble 6 ticks" in inter and "38 ticks" in inter  # same idle ticks, each half as long
    main(["--pp", "2", "--microbatches", "2", "--chunks", "2", "--vertical"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["tick", "rank", "0", "rank", "1"]
