"""How one training step is executed: eagerly, or captured once as a CUDA graph and replayed one step ahead.

The training loop asks an executor for one step at a time and does not know which kind it has::

    result = executor.step(run_ahead=...)   # StepResult(losses, update_ok, grad_norm) of the next step
    executor.in_flight                      # True while a later step was launched and is not read yet

Every executor splits a step in two: ``launch(ahead)`` starts it and returns a handle, ``finish(handle)`` reads its
results. ``step()`` is the same for all of them: it finishes the step launched ahead (or launches one now),
optionally launches the following step before reading this one (when the loop allows it and the executor can),
advances the learning-rate schedule when the step updated the parameters, and, when no step is left in flight,
waits for the device so that the loop's clock measures the whole step.

* ``EagerStep`` runs the whole step inside ``launch`` (the forward/backward schedule, then the optimizer step) and
  never runs ahead.
* ``CudaGraphStep`` (``--enable-cuda-graph``) drives a ``FullIterationCudaGraph`` (``cuda_graph.py``): warm-up
  steps run eagerly, the next one is captured, later ones are replayed. A replay may be launched before the
  previous replay's results are read; its learning rate then depends on whether that previous step updates, so
  the graph gets both candidates and picks on the device.

A new way of executing a step (e.g. a graph per pipeline stage) is a subclass of ``StepExecutor`` with ``launch``
and ``finish``, plus ``can_run_ahead`` if it can launch a step before the previous one is read;
``Trainer.make_step_executor`` chooses it from the flags.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, NamedTuple, Optional

import torch

from megatron.training.cuda_graph import FullIterationCudaGraph
from megatron.training.scheduler import OptimizerParamScheduler


class StepResult(NamedTuple):
    """One step's outcome: each loss statistic's mean (on the last pipeline stage; ``{}`` elsewhere), whether the
    optimizer updated the parameters (False: skipped for a non-finite gradient), and the gradient norm (None
    when the optimizer does not compute one)."""

    losses: Dict[str, float]
    update_ok: bool
    grad_norm: Optional[float]


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepExecutor(abc.ABC):
    """Runs training steps one after the other, possibly launching the next before reading the current one.

    Subclasses implement ``launch(ahead)`` (start a step, return a handle) and ``finish(handle)`` (its
    ``(losses, update_ok, grad_norm)``), and may allow running ahead through ``can_run_ahead``.
    """

    def __init__(self, scheduler: OptimizerParamScheduler):
        self.scheduler = scheduler
        self._pending = None  # the handle of a step launched ahead, not read yet

    @property
    def in_flight(self) -> bool:
        """Whether a step was launched ahead and is still unread (the next ``step()`` returns its results)."""
        return self._pending is not None

    def can_run_ahead(self) -> bool:
        """Whether the next step may be launched now, before the one just launched is read."""
        return False

    @abc.abstractmethod
    def launch(self, ahead: bool):
        """Start one step; ``ahead``: the previous launched step is still unread. Returns ``finish``'s handle."""

    @abc.abstractmethod
    def finish(self, handle) -> tuple:
        """``(losses, update_ok, grad_norm)`` of a launched step."""

    def step(self, run_ahead: bool) -> StepResult:
        """The results of the next step. ``run_ahead``: the caller has nothing to do between this step and the
        following one, so the following one may be launched before this one is read (if this executor can)."""
        handle = self._pending if self._pending is not None else self.launch(ahead=False)
        self._pending = None
        if run_ahead and self.can_run_ahead():
            self._pending = self.launch(ahead=True)
        result = StepResult(*self.finish(handle))
        if result.update_ok:
            self.scheduler.step(1)  # the schedule advances on successful updates only
        if self._pending is None:
            _synchronize()
        return result


class EagerStep(StepExecutor):
    """The whole step runs when it is launched: ``step_fn()`` returns ``(losses, update_ok, grad_norm)``."""

    def __init__(self, step_fn: Callable[[], tuple], scheduler: OptimizerParamScheduler):
        super().__init__(scheduler)
        self.step_fn = step_fn

    def launch(self, ahead: bool):
        return self.step_fn()

    def finish(self, handle) -> tuple:
        return handle


class CudaGraphStep(StepExecutor):
    """Steps of a ``FullIterationCudaGraph``: eager warm-up, one capture, then replays that may run one ahead."""

    def __init__(self, graph: FullIterationCudaGraph, scheduler: OptimizerParamScheduler):
        super().__init__(scheduler)
        self.graph = graph

    def can_run_ahead(self) -> bool:
        return self.graph.replaying  # warm-up steps and the capture run synchronously

    def launch(self, ahead: bool):
        # Ahead, the unread step advances the schedule only if it updates, so this step's rate is either the one
        # after one more scheduler step (it updated) or the current one (it was skipped); the graph picks.
        now = self.scheduler.group_lrs(0)
        return self.graph.launch(self.scheduler.group_lrs(1) if ahead else now, now)

    def finish(self, handle) -> tuple:
        return self.graph.finish(handle)
