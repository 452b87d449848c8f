"""Whole-iteration CUDA graphs (``--enable-cuda-graph``): capture one training step once, replay it every step.

A small model's iteration is bounded by the host: hundreds of kernel launches, each a few microseconds of Python
and driver time, plus the host synchronisations of the optimizer step. Capturing the step in a CUDA graph turns
all of that into one launch. What is captured: zeroing the gradient buffers, the forward and backward of every
microbatch (the same schedule function as the eager step), the gradient norm, clipping and the fused AdamW update
(:meth:`MegatronOptimizer.step_without_sync`), and the copy of the fp32 main params into the model params.

What stays on the host, outside the graph:

* the data loader: each step's microbatches are copied into static device buffers the graph reads; the host
  fetches them from the loader (and pins them) while the previous step's replay runs, so the GPU does not wait
  for the loader;
* the learning-rate schedule: the scheduler writes Python floats as usual; before each replay they are copied
  into the device tensors the captured optimizer reads (see "running ahead" below);
* logging: the graph ends by averaging each loss statistic over the microbatches (the trainer's
  ``microbatch_means``, as in the eager step) and packing those means, ``found_inf`` and the grad norm into one
  small tensor; one asynchronous copy brings it to pinned host memory,
  the only read-back of a step.

The first ``warmup_steps`` iterations run eagerly on a side stream (cuBLAS/cuDNN/Triton/torch.compile warm up and
allocate there), the next one is captured and replayed, and every later one is only replayed. A skipped update
(non-finite grad norm) is done by the fused AdamW itself (``found_inf``), so nothing in the graph depends on a
value read back by the host.

Running ahead: a step is ``launch``-ed and later ``finish``-ed (its results read). ``CudaGraphStep``
(``step_executor.py``) launches step ``n + 1`` before it reads step ``n``'s results whenever the training loop has
nothing to do between the two (no evaluation, checkpoint or exit after step ``n``), so the GPU replays step
``n + 1`` while the host logs step ``n``. The learning rate of step ``n + 1`` depends on whether step ``n`` was
skipped (the schedule only advances on successful steps), which the host does not know yet: it provides both
candidates, and the graph itself picks one from the previous replay's ``found_inf``
(``lr = found_inf ? lr_if_skipped : lr_if_ok``), so the schedule is exactly that of the eager trainer.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch


class _StaticBatches:
    """The iterator the captured step reads: it hands out the same static device batches, in order."""

    def __init__(self, batches: List[Dict[str, torch.Tensor]]):
        self.batches, self.index = batches, 0

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        batch = self.batches[self.index % len(self.batches)]
        self.index += 1
        return batch


class FullIterationCudaGraph:
    """Runs training steps through one captured CUDA graph.

    ``eager_step()`` is the trainer's ordinary step (``Trainer.train_step``: returns ``(mean loss statistics,
    update_ok, grad_norm)``);
    ``captured_body(data_iterator)`` runs one step's GPU work without host synchronisation and returns
    ``(mean loss statistics {name: 0-dim tensor}, found_inf, grad_norm)``, all on the device; ``torch_optimizer`` is the optimizer whose
    ``lr`` the scheduler sets.
    """

    def __init__(self, data_iterator, num_microbatches: int, eager_step: Callable[[], tuple],
                 captured_body: Callable[[object], tuple], torch_optimizer: torch.optim.Optimizer,
                 warmup_steps: int, device: torch.device):
        if device.type != "cuda":
            raise ValueError("--enable-cuda-graph needs a CUDA device")
        if warmup_steps < 1:
            raise ValueError(f"--cuda-graph-warmup-steps must be >= 1, got {warmup_steps}")
        self.data_iterator, self.num_microbatches = data_iterator, num_microbatches
        self.eager_step, self.captured_body = eager_step, captured_body
        self.torch_optimizer, self.warmup_steps, self.device = torch_optimizer, warmup_steps, device
        self.steps_run = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.stream = torch.cuda.Stream(device=device)
        self.static_batches: List[Dict[str, torch.Tensor]] = []
        # the learning rate the captured AdamW reads, and its two candidates (see the module docstring)
        self.lr_tensors: List[torch.Tensor] = []
        self.lr_if_ok: List[torch.Tensor] = []
        self.lr_if_skipped: List[torch.Tensor] = []
        self.last_found_inf = torch.zeros((), dtype=torch.float32, device=device)  # of the latest replay
        self.keys: List[str] = []  # the loss statistics, in the order of the packed outputs
        self.packed: Optional[torch.Tensor] = None  # [means of the keys..., found_inf, grad_norm] on the device
        # two pinned host copies of it with their events: one for the step being read, one for the step ahead
        self.packed_host: List[torch.Tensor] = []
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.prefetched: Optional[List[Dict[str, torch.Tensor]]] = None

    @property
    def replaying(self) -> bool:
        """True once the graph is captured: every later launch is a replay (and may run ahead)."""
        return self.graph is not None

    # ---- data -------------------------------------------------------------------------------------------
    def _fetch(self) -> Optional[List[Dict[str, torch.Tensor]]]:
        """The next step's microbatches from the loader (host work only), or None once it is exhausted."""
        try:
            batches = [next(self.data_iterator) for _ in range(self.num_microbatches)]
        except StopIteration:
            return None
        return [{k: v.pin_memory() for k, v in batch.items()} for batch in batches]  # copied asynchronously

    def _load_batches(self) -> None:
        """Copy this step's microbatches (fetched during the previous replay, else now) into the static buffers."""
        batches, self.prefetched = self.prefetched, None
        if batches is None:
            batches = [next(self.data_iterator) for _ in range(self.num_microbatches)]
        for i, batch in enumerate(batches):
            if i == len(self.static_batches):
                self.static_batches.append({k: torch.empty(v.shape, dtype=v.dtype, device=self.device)
                                            for k, v in batch.items()})
            static = self.static_batches[i]
            if set(batch) != set(static):
                raise ValueError(f"--enable-cuda-graph: batch keys changed from {sorted(static)} to {sorted(batch)}")
            for k, v in batch.items():
                if v.shape != static[k].shape or v.dtype != static[k].dtype:
                    raise ValueError(f"--enable-cuda-graph needs fixed-shape batches: {k!r} was "
                                     f"{tuple(static[k].shape)} {static[k].dtype}, now {tuple(v.shape)} {v.dtype}")
                static[k].copy_(v, non_blocking=True)

    def _load_lr(self, lrs_if_ok: List[float], lrs_if_skipped: List[float]) -> None:
        for tensor, lr in zip(self.lr_if_ok, lrs_if_ok):
            tensor.fill_(float(lr))
        for tensor, lr in zip(self.lr_if_skipped, lrs_if_skipped):
            tensor.fill_(float(lr))

    # ---- steps ------------------------------------------------------------------------------------------
    def _warmup_step(self) -> tuple:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            result = self.eager_step()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return result

    def _capture(self) -> None:
        groups = self.torch_optimizer.param_groups

        def scalars():
            return [torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device) for g in groups]

        self.lr_tensors, self.lr_if_ok, self.lr_if_skipped = scalars(), scalars(), scalars()
        floats = [g["lr"] for g in groups]
        for group, tensor in zip(groups, self.lr_tensors):
            group["lr"] = tensor  # the captured fused AdamW reads the learning rate from this tensor
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, stream=self.stream):
                skipped = self.last_found_inf > 0
                for lr, if_ok, if_skipped in zip(self.lr_tensors, self.lr_if_ok, self.lr_if_skipped):
                    torch.where(skipped, if_skipped, if_ok, out=lr)
                means, found_inf, grad_norm = self.captured_body(_StaticBatches(self.static_batches))
                self.last_found_inf.copy_(found_inf.reshape(()))
                self.keys = list(means)
                self.packed = torch.stack([*means.values(), found_inf.float().reshape(()),
                                           grad_norm.float().reshape(())])
            self.packed_host = [torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
                                for _ in range(2)]
        finally:
            for group, value in zip(groups, floats):
                group["lr"] = value  # the scheduler and checkpoints keep seeing floats

    def launch(self, lrs_if_ok: List[float], lrs_if_skipped: List[float]):
        """Start one training iteration; returns what ``finish`` reads its results from.

        ``lrs_if_ok`` / ``lrs_if_skipped``: each param group's learning rate for this step if the step before it
        updated / was skipped; equal unless a launched step is still unread. A warm-up step runs eagerly and
        synchronously (the returned handle holds its results; both lists must then be equal).
        """
        self.steps_run += 1
        if self.steps_run <= self.warmup_steps:
            return ("done", self._warmup_step())
        self._load_batches()
        if self.graph is None:
            self._capture()
        self._load_lr(lrs_if_ok, lrs_if_skipped)
        self.graph.replay()
        slot = self.steps_run % 2
        self.packed_host[slot].copy_(self.packed, non_blocking=True)
        self.copied[slot].record()
        self.prefetched = self._fetch()  # the host fetches the next step's batches while the GPU replays
        return ("replay", slot)

    def finish(self, handle) -> Tuple[Dict[str, float], bool, Optional[float]]:
        """``(mean loss statistics, update_ok, grad_norm)`` of a launched iteration, like the eager step."""
        kind, value = handle
        if kind == "done":
            return value
        self.copied[value].synchronize()
        *means, found_inf, grad_norm = self.packed_host[value].tolist()
        return dict(zip(self.keys, means)), found_inf == 0.0, grad_norm
