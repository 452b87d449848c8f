"""The arrival counters of the last-program finishing kernels (``_triton_elementwise._block_counters``): one
zeroed array per device and stream, reused, and an outgrown array kept alive (a captured CUDA graph may still
use its memory). Runs on CPU: only the host-side bookkeeping is tested here; the kernels are in tests/gpu."""

import pytest
import torch

te = pytest.importorskip("megatron.core.fusions._triton_elementwise")


def test_counters_are_reused_and_outgrown_arrays_are_kept(monkeypatch):
    monkeypatch.setattr(te, "_COUNTERS", {})
    monkeypatch.setattr(te, "_OUTGROWN_COUNTERS", [])
    dev = torch.device("cpu", 0)
    first = te._block_counters(dev, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert te._block_counters(dev, 10) is first  # reused, not reallocated per call
    bigger = te._block_counters(dev, first.numel() + 1)
    assert bigger is not first and bigger.numel() > first.numel() and not bigger.any()
    assert any(t is first for t in te._OUTGROWN_COUNTERS)  # never freed
    assert te._block_counters(dev, 10) is bigger
