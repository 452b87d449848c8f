"""The generation engine: the KV-cached path against full recomputation, sampling, stopping, log-probs."""

import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams, sample_next
from megatron.core.tokenizer import build_tokenizer
from megatron.core.transformer.attention import CoreAttention
from tests.unit.inference.tiny import MERGES, VOCAB, random_prompts, tiny_args, tiny_model


@pytest.fixture(scope="module")
def engine():
    return InferenceEngine(tiny_model(tiny_args()), eod=0)


def _recompute_greedy(engine, prompt, steps):
    """Greedy continuation recomputing the whole sequence at every step (no cache); the logits of every step."""
    seq, step_logits = list(prompt), []
    for _ in range(steps):
        logits = engine.forward_logits(torch.tensor([seq]))[0, -1]  # [V]
        step_logits.append(logits)
        seq.append(int(logits.argmax()))
    return seq, step_logits


def test_kv_cache_greedy_equals_full_recomputation(engine):
    prompts = random_prompts([3, 9, 5, 1])
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True, stop_on_eod=False,
                                                   logprobs=True))
    for prompt, out in zip(prompts, outs):
        ref, step_logits = _recompute_greedy(engine, prompt, 12)
        assert out.tokens == ref
        assert out.finish_reason == "length" and len(out.generated) == 12
        assert len(set(out.generated)) > 2  # the random model does not just repeat one token
        # each generated token's log-prob equals the recomputed step's log-softmax
        for k, logits in enumerate(step_logits):
            want = logits.log_softmax(-1)[ref[len(prompt) + k]].item()
            assert abs(out.logprobs[len(prompt) + k - 1] - want) < 1e-5


def test_prompt_logprobs_match_full_forward(engine):
    prompts = random_prompts([7, 4], seed=3)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=0, logprobs=True, stop_on_eod=False))
    for prompt, out in zip(prompts, outs):
        assert out.tokens == prompt and out.generated == []
        lp = engine.forward_logits(torch.tensor([prompt]))[0].log_softmax(-1)  # [s, V]
        want = lp[:-1].gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, rtol=0, atol=1e-5)


def test_batch_equals_one_prompt_at_a_time(engine):
    prompts = random_prompts([2, 6, 4], seed=5)
    greedy = SamplingParams(max_new_tokens=8, greedy=True, stop_on_eod=False, logprobs=True)
    batched = engine.generate(prompts, greedy)
    for prompt, out in zip(prompts, batched):
        alone = engine.generate([prompt], greedy)[0]
        assert out.tokens == alone.tokens
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5)


def test_seed_reproduces_and_differs(engine):
    prompts = random_prompts([4, 4], seed=1)
    p = dict(max_new_tokens=10, temperature=1.5, stop_on_eod=False)
    a = engine.generate(prompts, SamplingParams(seed=7, **p))
    b = engine.generate(prompts, SamplingParams(seed=7, **p))
    c = engine.generate(prompts, SamplingParams(seed=8, **p))
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.tokens for o in a] != [o.tokens for o in c]


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    prompts = random_prompts([5, 3], seed=2)
    greedy = [o.tokens for o in engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True,
                                                                          stop_on_eod=False))]
    for extra in (dict(top_k=1), dict(top_p=1e-6)):
        got = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=2.0, seed=3,
                                                      stop_on_eod=False, **extra))
        assert [o.tokens for o in got] == greedy


def test_sampling_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 9.0]]).repeat(2000, 1)  # last id is padding
    top2 = sample_next(logits, SamplingParams(top_k=2), vocab_size=5, generator=g)
    assert set(top2.tolist()) == {0, 1}  # the padded id 5 is never chosen
    # probabilities over ids 0..4 are about .64 .23 .09 .03 .01: top_p .8 keeps ids 0 and 1
    nucleus = sample_next(logits, SamplingParams(top_p=0.8), vocab_size=5, generator=g)
    assert set(nucleus.tolist()) == {0, 1}
    # plain sampling at temperature 1 follows the softmax
    free = sample_next(logits, SamplingParams(), vocab_size=5, generator=g)
    freq = torch.bincount(free, minlength=5).float() / free.numel()
    torch.testing.assert_close(freq, logits[0, :5].softmax(-1), rtol=0, atol=0.04)
    assert sample_next(logits[:1], SamplingParams(greedy=True), vocab_size=6, generator=g).item() == 5


def test_stop_on_eod(engine):
    prompt = random_prompts([5], seed=9)[0]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=10, greedy=True, stop_on_eod=False))[0]
    eod = free.generated[3]
    first = free.generated.index(eod)
    stopper = InferenceEngine(engine.model, eod=eod)
    out = stopper.generate([prompt], SamplingParams(max_new_tokens=10, greedy=True))[0]
    assert out.finish_reason == "eod" and out.generated == free.generated[:first + 1]


def test_stop_strings_and_eol_with_tokenizer(engine):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    text_engine = InferenceEngine(engine.model, tokenizer=tok, vocab_size=128)
    prompt = [tok.tokenize("a")[0]]
    free = text_engine.generate([prompt], SamplingParams(max_new_tokens=12, greedy=True, stop_on_eod=False))[0]
    stop = free.text[3:5]
    cut = free.text.index(stop)
    out = text_engine.generate([prompt], SamplingParams(max_new_tokens=12, greedy=True, stop_on_eod=False,
                                                        stop_strings=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == free.text[:cut]
    assert free.tokens[:len(out.tokens)] == out.tokens and len(out.tokens) < len(free.tokens)


def test_bad_prompts_are_rejected(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1], []], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="exceeds the model's 48 positions"):
        engine.generate([[1] * 40], SamplingParams(max_new_tokens=9))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 128]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_engines_over_one_model_own_their_caches_and_leave_the_model_unchanged(engine):
    """The cache is the forward's inference context, not a part installed in the model: a second engine over the
    same model has its own, and the layers keep their attention cores."""
    other = InferenceEngine(engine.model, eod=0)
    assert other.cache is not engine.cache
    assert all(type(layer.self_attention.core_attention) is CoreAttention for layer in engine.model.decoder.layers)
    prompts = random_prompts([3, 6], seed=12)
    greedy = SamplingParams(max_new_tokens=5, greedy=True, stop_on_eod=False)
    assert [o.tokens for o in engine.generate(prompts, greedy)] == [o.tokens for o in other.generate(prompts, greedy)]
