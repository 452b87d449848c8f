"""The static decoding step (position in a device tensor, attention over the whole cache with later positions
masked) gives the dynamic step's tokens and log-probs, run eagerly on the CPU.

The CUDA graph that replays the step is tested on the GPU (tests/gpu/test_generation_graph.py); tensor
parallelism over gloo is in test_checkpoint_load.py (TP=2 and PP=2, static and dynamic, against TP=1).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.inference.decode_step import static_capacity
from megatron.core.inference.kv_cache import attention_shape
from tests.unit.inference.tiny import random_prompts, tiny_args, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_args())


def _pair(model, **kw):
    return InferenceEngine(model, eod=0, **kw), InferenceEngine(model, eod=0, static_decode=False)


def _assert_same(got, want, atol=1e-5):
    assert [o.tokens for o in got] == [o.tokens for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    if want[0].logprobs is not None:
        for a, b in zip(got, want):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=atol)
    if want[0].top_logprobs is not None:
        for a, b in zip(got, want):
            assert [[t for t, _ in pos] for pos in a.top_logprobs] == [[t for t, _ in pos] for pos in b.top_logprobs]


def test_greedy_and_logprobs_equal_the_dynamic_step(model):
    static, dynamic = _pair(model)
    assert static.static_decode and not static.use_cuda_graph  # CPU: the static step runs eagerly
    prompts = random_prompts([3, 9, 5, 1], seed=21)
    params = SamplingParams(max_new_tokens=14, greedy=True, stop_on_eod=False, logprobs=True, top_logprobs=3)
    got, want = static.generate(prompts, params), dynamic.generate(prompts, params)
    _assert_same(got, want)
    assert all(len(set(o.generated)) > 2 for o in got)  # the random model does not repeat one token
    # one static step was built, for this batch and the total length rounded up (here: the model's 48 positions)
    assert list(static._steps) == [(4, static_capacity(9 + 14, 48))] and static_capacity(9 + 14, 48) == 48


@pytest.mark.parametrize("extra", [dict(temperature=1.3), dict(temperature=0.9, top_k=5),
                                   dict(temperature=1.2, top_p=0.9)])
def test_seeded_sampling_equals_the_dynamic_step(model, extra):
    static, dynamic = _pair(model)
    prompts = random_prompts([6, 2, 4], seed=22)
    params = SamplingParams(max_new_tokens=12, seed=5, stop_on_eod=False, logprobs=True, **extra)
    got, want = static.generate(prompts, params), dynamic.generate(prompts, params)
    _assert_same(got, want)
    other_seed = static.generate(prompts, SamplingParams(max_new_tokens=12, seed=6, stop_on_eod=False, **extra))
    assert [o.tokens for o in other_seed] != [o.tokens for o in got]


def test_prompt_scoring_and_early_stops_equal_the_dynamic_step(model):
    static, dynamic = _pair(model)
    prompts = random_prompts([2, 11, 7], seed=23)
    # no new tokens: the longer prompts are scored one static step at a time after the shortest one
    score = SamplingParams(max_new_tokens=0, logprobs=True, stop_on_eod=False)
    _assert_same(static.generate(prompts, score), dynamic.generate(prompts, score))
    # sequences that stop early (at an end-of-document id the model emits) while the others go on
    free = dynamic.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_on_eod=False))
    eod = free[0].generated[2]
    static_eod, dynamic_eod = (InferenceEngine(model, eod=eod, static_decode=s) for s in (True, False))
    params = SamplingParams(max_new_tokens=10, greedy=True, logprobs=True)
    got, want = static_eod.generate(prompts, params), dynamic_eod.generate(prompts, params)
    _assert_same(got, want)
    assert got[0].finish_reason == "eod" and "length" in [o.finish_reason for o in got]


def test_kept_step_is_reused_and_least_recent_dropped(model):
    static = InferenceEngine(model, eod=0, max_decode_steps=1)
    greedy = SamplingParams(max_new_tokens=8, greedy=True, stop_on_eod=False, logprobs=True)
    first, second = random_prompts([5, 8], seed=24), random_prompts([9, 3], seed=25)
    static.generate(first, greedy)
    step = static._steps[(2, 48)]
    keys = step.keys[0].clone()
    got = static.generate(second, greedy)  # same batch and capacity: the same step and buffers
    assert static._steps[(2, 48)] is step and not torch.equal(step.keys[0], keys)
    # positions the first call filled past the second call's length do not leak into it
    _assert_same(got, InferenceEngine(model, eod=0, static_decode=False).generate(second, greedy))
    single = static.generate([second[0]], greedy)  # batch 1: a new step, the batch-2 one is dropped
    assert list(static._steps) == [(1, 48)]
    _assert_same(single, got[:1])


def test_bad_options_are_refused(model):
    with pytest.raises(ValueError, match="use_cuda_graph: cannot capture the decoding step: the model is on cpu"):
        InferenceEngine(model, use_cuda_graph=True)
    with pytest.raises(ValueError, match="max_decode_steps must be >= 1"):
        InferenceEngine(model, max_decode_steps=0)
    engine = InferenceEngine(model, eod=0)
    step = engine._decode_step(1, 10)
    with pytest.raises(ValueError, match="position 48 is outside the static step's 48 positions"):
        step(torch.zeros(1, 1, dtype=torch.long), 48)


class _OpRecorder(TorchDispatchMode):
    """Records every ATen call with its arguments (tensors as shape and dtype, anything else as it is)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        described = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in flat)
        self.calls.append((str(func), described))
        return func(*args, **kwargs)


def _recorded(fn):
    with _OpRecorder() as rec:
        fn()
    return rec.calls


def test_static_step_runs_the_same_ops_at_every_position(model):
    """What a CUDA graph needs, checked on the CPU: the step's ATen calls, their shapes and their non-tensor
    arguments do not depend on the position, and none of them reads a value back to the host."""
    b, n = 3, 6
    shape = attention_shape(model)
    tokens = torch.tensor(random_prompts([20] * b, seed=26))  # [b, 20]
    static = InferenceEngine(model, eod=0)
    step = static._decode_step(b, 20)
    step.bind()
    try:
        static._logits(tokens[:, :n], 0, last_only=True)  # the prompt pass over positions 0 .. n-1
        calls = []
        for p in (n, n + 1, n + 9):
            step.tokens.copy_(tokens[:, p:p + 1])  # the inputs the engine sets before each step
            step.position.fill_(p)
            calls.append(_recorded(step._run))  # what the graph records and replays
    finally:
        static.cache.release()
    names = [name for name, _ in calls[0]]
    assert names.count("aten.index_copy_.default") == 2 * shape.num_layers  # keys and values written in place
    assert calls[0] == calls[1] == calls[2]
    assert not [name for name, _ in calls[0] if "_local_scalar_dense" in name or "item" in name]
    # the dynamic step, for contrast, changes its shapes with the position
    dynamic = InferenceEngine(model, eod=0, static_decode=False)
    dynamic.cache.allocate(shape, b, 20, torch.float32, torch.device("cpu"))
    try:
        dynamic._logits(tokens[:, :n], 0, last_only=True)
        dyn = []
        for p in (n, n + 1):
            dynamic.cache.offset = p
            dyn.append(_recorded(lambda p=p: dynamic._logits(tokens[:, p:p + 1], p, last_only=True)))
    finally:
        dynamic.cache.release()
    assert dyn[0] != dyn[1]
