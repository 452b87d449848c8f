"""The PP=1 schedule: gradient accumulation with one DP synchronisation per step."""

import contextlib

import pytest
import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func
from tests.unit.pipeline_parallel.toy_model import (
    HIDDEN, MBS, SEQ, ToyStage, forward_step_func, full_layers, make_batches, reference_step,
)


class SyncRecorder:
    """A no_sync factory that records, for every backward, whether it ran inside no_sync."""

    def __init__(self, model):
        self.inside = False
        self.log = []
        for p in model.parameters():
            p.register_hook(self._hook)

    def _hook(self, grad):
        self.log.append(self.inside)
        return grad

    @contextlib.contextmanager
    def __call__(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


@pytest.mark.parametrize("num_microbatches", [1, 3])
def test_accumulation_matches_reference(num_microbatches):
    layers = full_layers(2)
    batches = make_batches(num_microbatches)
    ref_losses, ref_grads = reference_step(layers, batches)

    model = ToyStage(layers, 0, 2, True, True)
    recorder = SyncRecorder(model)
    finalized = []
    scaled = []

    def grad_scale(loss):
        scaled.append(loss.item())
        return loss * 4.0

    fb = get_forward_backward_func(ParallelState.single())
    assert fb is forward_backward_no_pipelining
    stats = fb(forward_step_func, iter(batches), [model], num_microbatches, SEQ, MBS, HIDDEN, torch.float32,
               ParallelState.single(), grad_scale_func=grad_scale, no_sync_func=recorder,
               finalize_grads_func=finalized.append)
    assert [s["loss"].item() for s in stats] == pytest.approx(ref_losses, abs=1e-7)
    # grad_scale_func sees the loss already divided by the number of microbatches
    assert scaled == pytest.approx([l / num_microbatches for l in ref_losses], abs=1e-7)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 4.0 * ref_grads[name], rtol=0, atol=1e-6)
    # 4 params per microbatch; only the last microbatch's backward runs outside no_sync
    assert recorder.log == [True] * 4 * (num_microbatches - 1) + [False] * 4
    assert len(finalized) == 1 and finalized[0] == [model]


def test_forward_only():
    layers = full_layers(2)
    batches = make_batches(2)
    ref_losses, _ = reference_step(layers, batches, backward=False)
    model = ToyStage(layers, 0, 2, True, True)
    finalized = []
    stats = forward_backward_no_pipelining(
        forward_step_func, [iter(batches)], model, 2, SEQ, MBS, HIDDEN, torch.float32, ParallelState.single(),
        forward_only=True, finalize_grads_func=finalized.append,
    )
    assert [s["loss"].item() for s in stats] == pytest.approx(ref_losses, abs=1e-7)
    assert all(p.grad is None for p in model.parameters())
    assert finalized == []


def test_rejects_bad_arguments():
    model = ToyStage(full_layers(1), 0, 1, True, True)
    with pytest.raises(ValueError, match="num_microbatches"):
        forward_backward_no_pipelining(forward_step_func, iter([]), [model], 0, SEQ, MBS, HIDDEN,
                                       torch.float32, ParallelState.single())
    with pytest.raises(ValueError, match="2 chunks"):
        forward_backward_no_pipelining(forward_step_func, iter([]), [model, model], 1, SEQ, MBS, HIDDEN,
                                       torch.float32, ParallelState.single())
