"""Random-number-generator states for tensor parallelism, and activation recomputation that replays them.

Rules (Megatron): dropout on activations that are *replicated* across TP ranks (the residual stream without
sequence parallelism) must draw the same mask on every TP rank, so it uses the default generator, seeded
identically on all TP ranks. Dropout on activations that are *split* across TP ranks (attention probabilities of
this rank's heads; the residual stream under sequence parallelism) must draw different masks per rank, so it
runs inside ``get_rng_tracker().fork()``, whose "model-parallel-rng" state is seeded with ``seed + 2718 +
tp_rank``.

A tracked state is the pair (CPU generator state, CUDA generator state of the current device or ``None``):
``fork`` swaps both in and out, so dropout on CPU tensors (gloo tests) and CUDA tensors behave alike.
"""

from __future__ import annotations

import contextlib
import random as _pyrandom
from typing import Any, Dict, Optional

import numpy as np
import torch

from megatron.core.parallel_state import ParallelState

MODEL_PARALLEL_RNG = "model-parallel-rng"
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_device_states() -> Dict[str, Optional[torch.Tensor]]:
    """The default CPU generator state and the current CUDA device's state (``None`` without CUDA)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _set_device_states(states: Dict[str, Optional[torch.Tensor]]) -> None:
    torch.set_rng_state(states["cpu"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class RNGStatesTracker:
    """Named RNG states that can be swapped in for a block of code with ``fork(name)``."""

    def __init__(self) -> None:
        self._states: Dict[str, Dict[str, Optional[torch.Tensor]]] = {}
        self._seeds: Dict[str, int] = {}

    def reset(self) -> None:
        """Forget every tracked state."""
        self._states, self._seeds = {}, {}

    def names(self):
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; the current generator states are left untouched."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} is already tracked")
        for other, other_seed in self._seeds.items():
            if other_seed == seed:
                raise ValueError(f"seed {seed} is already used by RNG state {other!r}")
        saved = _get_device_states()
        torch.manual_seed(seed)  # seeds the CPU and the CUDA generators
        self._states[name] = _get_device_states()
        self._seeds[name] = seed
        _set_device_states(saved)

    def get_states(self) -> Dict[str, Dict[str, Optional[torch.Tensor]]]:
        """A copy of every tracked state: ``{name: {"cpu": ByteTensor, "cuda": ByteTensor | None}}``."""
        return {name: {k: (v.clone() if v is not None else None) for k, v in st.items()}
                for name, st in self._states.items()}

    def set_states(self, states: Dict[str, Dict[str, Optional[torch.Tensor]]]) -> None:
        """Replace the tracked states (as returned by ``get_states``; seeds are not restored).

        A state saved without CUDA (a CPU run) keeps this process's current CUDA state for that name, so resuming
        a CPU checkpoint on a GPU still gives each TP rank its own stream."""
        new = {}
        for name, st in states.items():
            new[name] = {k: (v.clone() if v is not None else None) for k, v in st.items()}
            if new[name].get("cuda") is None and name in self._states:
                new[name]["cuda"] = self._states[name].get("cuda")
        self._states = new

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with state ``name`` as the default generator state, then store its advanced state and
        restore the previous default state."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} is not tracked (call model_parallel_seed() first); "
                           f"tracked: {sorted(self._states)}")
        outer = _get_device_states()
        _set_device_states(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_device_states()
            _set_device_states(outer)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker."""
    return _TRACKER


def model_parallel_seed(seed: int, pstate: ParallelState) -> None:
    """Seed the default generators with ``seed`` (same on every TP rank) and reset the tracker to hold only
    "model-parallel-rng" seeded with ``seed + 2718 + tp_rank`` (different per TP rank)."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + pstate.tp_rank)


# --------------------------------------------------------------------------------------------------------------
# Checkpoint (RNG state for model_optim_rng.pt)
# --------------------------------------------------------------------------------------------------------------
def get_all_rng_states() -> Dict[str, Any]:
    """Every RNG state as plain types (lists, ints, floats, tensors) that ``torch.load(weights_only=True)`` reads:
    python ``random``, numpy, torch CPU, CUDA (current device, if present) and the tracker."""
    py_version, py_state, py_gauss = _pyrandom.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "random": [py_version, list(py_state), py_gauss],
        "np_random": [np_name, torch.from_numpy(np.asarray(np_keys, dtype=np.int64)), int(np_pos),
                      int(np_has_gauss), float(np_gauss)],
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": _TRACKER.get_states(),
    }


def set_all_rng_states(states: Dict[str, Any]) -> None:
    """Restore what ``get_all_rng_states`` returned (after a round trip through ``torch.save``/``torch.load``)."""
    py_version, py_state, py_gauss = states["random"]
    _pyrandom.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = states["np_random"]
    np.random.set_state((np_name, np.asarray(np_keys, dtype=np.int64).astype(np.uint32), int(np_pos),
                         int(np_has_gauss), float(np_gauss)))
    torch.set_rng_state(states["torch_cpu"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    _TRACKER.set_states(states["tracker"])


# --------------------------------------------------------------------------------------------------------------
# Activation recomputation
# --------------------------------------------------------------------------------------------------------------
class CheckpointFunction(torch.autograd.Function):
    """Forward: run ``function`` without building a graph, saving only its inputs and the RNG states.
    Backward: restore those RNG states, rerun ``function`` with grad enabled (same dropout masks), backpropagate
    through the recomputed graph, then restore the RNG states current at backward time."""

    @staticmethod
    def forward(ctx, function, _anchor, *args):
        ctx.function = function
        ctx.fwd_device_states = _get_device_states()
        ctx.fwd_tracker_states = _TRACKER.get_states()
        ctx.tensor_idx = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_idx])
        with torch.no_grad():
            outputs = function(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint(): recomputation does not work with torch.autograd.grad(); "
                               "use .backward()")
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            d = t.detach()
            d.requires_grad_(t.requires_grad)
            args[i] = d
        bwd_device_states, bwd_tracker_states = _get_device_states(), _TRACKER.get_states()
        _set_device_states(ctx.fwd_device_states)
        _TRACKER.set_states(ctx.fwd_tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _set_device_states(bwd_device_states)
            _TRACKER.set_states(bwd_tracker_states)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None) + input_grads


def checkpoint(function, *args):
    """Run ``function(*args)`` now without keeping its activations; recompute them during backward with the
    forward-time RNG states (default and tracker), so dropout masks match a run without recomputation.

    Gradients reach ``function``'s parameters even when no input requires grad (a hidden anchor tensor keeps the
    recomputation in the graph). Use ``.backward()``, not ``torch.autograd.grad``.
    """
    anchor = torch.empty(0, requires_grad=True)
    return CheckpointFunction.apply(function, anchor, *args)
