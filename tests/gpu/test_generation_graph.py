"""The captured decoding step (GPU only): graph replay = the eager static step = the dynamic step.

A tiny GPT on CUDA generates with three engines over the same model: the default (the static step replayed from a
CUDA graph), ``use_cuda_graph=False`` (the same step run eagerly) and ``static_decode=False`` (the dynamic step,
attention over the filled positions only). The graph runs the eager step's kernels, so the two agree exactly. The
dynamic step runs other attention kernels (over fewer keys, without a mask): in fp32 it agrees token for token and
to 1e-4 in log-prob; in bf16 a sequence may part from it only where the dynamic step's two most likely tokens lie
within bf16 rounding of each other, and agrees before that.
"""

import json

import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed
from tests.unit.inference.tiny import random_prompts, tiny_args, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# 128 positions: a call of at most 64 positions uses a 64-position step, a longer one a 128-position step
ARGS = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=128, seq_length=128)
PROMPT_LENGTHS = [3, 17, 9, 1]
# log-prob units: bf16 rounding of the logits (|logit| up to ~10) and of the attention; the static and dynamic
# steps of this model differ by up to about 0.06 over 40 bf16 steps on the CPU
BF16_TOL = 0.25


@pytest.fixture(autouse=True)
def exact_fp32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def _model(dtype: torch.dtype):
    return tiny_model(tiny_args(**ARGS)).to(device="cuda", dtype=dtype).eval()


def _engines(model):
    graph = InferenceEngine(model, eod=0)
    eager = InferenceEngine(model, eod=0, use_cuda_graph=False)
    dynamic = InferenceEngine(model, eod=0, static_decode=False)
    assert graph.use_cuda_graph and graph.static_decode  # the default on CUDA
    assert not eager.use_cuda_graph and eager.static_decode
    return graph, eager, dynamic


def _assert_exact(got, want):
    assert [o.tokens for o in got] == [o.tokens for o in want]
    for a, b in zip(got, want):
        if b.logprobs is not None:
            assert a.logprobs == b.logprobs


def _assert_close(got, want, atol):
    assert [o.tokens for o in got] == [o.tokens for o in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=atol)
        assert [[t for t, _ in pos] for pos in a.top_logprobs] == [[t for t, _ in pos] for pos in b.top_logprobs]


def _assert_same_up_to_near_ties(got, want, tol):
    """Each sequence equals the reference up to its first different generated token, with log-probs within
    ``tol`` before it; there the token chosen instead must be among the reference's most likely ones, within
    ``tol`` of the reference's choice."""
    for a, b in zip(got, want):
        n = b.prompt_length
        assert a.tokens[:n] == b.tokens[:n]
        gen_a, gen_b = a.generated, b.generated
        k = next((j for j, (x, y) in enumerate(zip(gen_a, gen_b)) if x != y), min(len(gen_a), len(gen_b)))
        diffs = [abs(x - y) for x, y in zip(a.logprobs[:n - 1 + k], b.logprobs[:n - 1 + k])]
        assert max(diffs, default=0.0) <= tol, (max(diffs), k)
        if k < len(gen_b):
            ranked = dict(b.top_logprobs[k])  # token -> the reference's log-prob, its most likely few
            assert gen_a[k] in ranked, f"parted at generated token {k} on a token the reference ranks low"
            margin = ranked[gen_b[k]] - ranked[gen_a[k]]
            assert margin <= tol, f"parted at generated token {k} where the margin is {margin:.3f}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_equals_eager_static_equals_dynamic_greedy(precision):
    graph, eager, dynamic = _engines(_model(DTYPES[precision]))
    prompts = random_prompts(PROMPT_LENGTHS, seed=31)
    params = SamplingParams(max_new_tokens=40, greedy=True, stop_on_eod=False, logprobs=True, top_logprobs=3)
    got = graph.generate(prompts, params)
    step = graph._steps[(4, 64)]  # 17 + 40 positions, rounded up to 64
    assert step.captured
    by_eager, by_dynamic = eager.generate(prompts, params), dynamic.generate(prompts, params)
    assert not eager._steps[(4, 64)].captured
    _assert_exact(got, by_eager)
    if precision == "fp32":
        _assert_close(got, by_dynamic, atol=1e-4)
    else:
        _assert_same_up_to_near_ties(got, by_dynamic, BF16_TOL)
    # the next call of the same batch and capacity replays the same graph on other prompts
    again = graph.generate(random_prompts(PROMPT_LENGTHS, seed=32), params)
    assert graph._steps[(4, 64)] is step and step.captured
    _assert_exact(again, eager.generate(random_prompts(PROMPT_LENGTHS, seed=32), params))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_equals_eager_static_seeded_sampling(precision):
    graph, eager, dynamic = _engines(_model(DTYPES[precision]))
    prompts = random_prompts([5, 2, 12], seed=33)
    # 12 + 70 positions: a 128-position step
    params = SamplingParams(max_new_tokens=70, temperature=1.1, top_p=0.95, seed=4, stop_on_eod=False,
                            logprobs=True)
    got = graph.generate(prompts, params)
    assert graph._steps[(3, 128)].captured
    _assert_exact(got, eager.generate(prompts, params))
    if precision == "fp32":
        want = dynamic.generate(prompts, params)
        assert [o.tokens for o in got] == [o.tokens for o in want]


def test_early_stops_and_prompt_scoring_under_the_graph():
    model = _model(torch.float32)
    graph, eager, _ = _engines(model)
    prompts = random_prompts([2, 11, 7], seed=34)
    score = SamplingParams(max_new_tokens=0, logprobs=True, stop_on_eod=False)
    _assert_exact(graph.generate(prompts, score), eager.generate(prompts, score))
    free = eager.generate(prompts, SamplingParams(max_new_tokens=20, greedy=True, stop_on_eod=False))
    eod = free[0].generated[3]
    params = SamplingParams(max_new_tokens=20, greedy=True, logprobs=True)
    got = InferenceEngine(model, eod=eod).generate(prompts, params)
    _assert_exact(got, InferenceEngine(model, eod=eod, use_cuda_graph=False).generate(prompts, params))
    assert got[0].finish_reason == "eod"


def _tp2_body(rank, world_size, out_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    pstate = ParallelState.build(tensor_model_parallel_size=2)
    engine = InferenceEngine(tiny_model(tiny_args(**ARGS), pstate), pstate, eod=0)
    assert engine.use_cuda_graph  # NCCL: the vocabulary gather is captured with the step
    params = SamplingParams(max_new_tokens=40, greedy=True, stop_on_eod=False, logprobs=True, top_logprobs=3)
    out = engine.generate(random_prompts(PROMPT_LENGTHS, seed=35), params)
    assert engine._steps[(4, 64)].captured
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump([[o.tokens, o.logprobs, o.top_logprobs] for o in out], f)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_tp2_graph_equals_tp1(tmp_path, monkeypatch):
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    out_path = str(tmp_path / "tp2.json")
    run_distributed(_tp2_body, world_size=2, args=(out_path,), backend="nccl", cuda=True)
    params = SamplingParams(max_new_tokens=40, greedy=True, stop_on_eod=False, logprobs=True, top_logprobs=3)
    want = InferenceEngine(_model(torch.float32), eod=0, static_decode=False).generate(
        random_prompts(PROMPT_LENGTHS, seed=35), params)
    for rank in range(2):
        got = json.load(open(f"{out_path}.{rank}"))
        assert [g[0] for g in got] == [o.tokens for o in want]
        for (_, logprobs, top), o in zip(got, want):
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(o.logprobs), rtol=0, atol=1e-4)
            assert [[t for t, _ in pos] for pos in top] == [[t for t, _ in pos] for pos in o.top_logprobs]
