"""Our model and engine against Hugging Face ``transformers``' GPT-2 holding the same weights."""

import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.inference.hf_gpt2 import to_hf_gpt2
from tests.unit.inference.tiny import random_prompts, tiny_args, tiny_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[False, True], ids=["tied", "untied"])
def pair(request):
    args = tiny_args(untie_embeddings_and_output_weights=request.param, layernorm_epsilon=1e-6)
    model = tiny_model(args)
    return InferenceEngine(model, eod=0), to_hf_gpt2(model)


def test_logits_equal_hf(pair):
    engine, hf = pair
    ids = torch.tensor(random_prompts([20, 20, 20], seed=6))
    ours = engine.forward_logits(ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_greedy_generation_equals_hf_generate(pair):
    engine, hf = pair
    prompts = random_prompts([1, 4, 9], seed=8)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16, greedy=True, stop_on_eod=False))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        assert out.tokens == ref[0].tolist()
