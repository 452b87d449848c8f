"""The inference tools read Megatron-LM's legacy checkpoints (here the fixture written by Megatron-Core itself,
``--tokenizer-type NullTokenizer --vocab-size 63`` data) through the trainer's readers, at any layout."""

import json
import os

import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams, load_gpt_for_inference
from tests.unit.checkpoint.helpers import FIXTURE
from tests.unit.checkpoint.test_convert import _run as convert
from tools import generate

PROMPT_LENGTHS = (3, 9, 14)


def _prompts(golden):
    """Prompts cut from the golden batch, as NullTokenizer text (ids separated by spaces)."""
    return [" ".join(str(t) for t in golden["tokens"][i % 2, :n].tolist()) for i, n in enumerate(PROMPT_LENGTHS)]


def _generate(capsys, load, prompts):
    argv = ["--load", load, "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--greedy",
            "--max-new-tokens", "2", "--ignore-eod", "--json", "--logprobs", "--device", "cpu", "--dtype", "fp32"]
    for p in prompts:
        argv += ["--prompt", p]
    assert generate.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_generate_reads_the_megatron_fixture_like_our_layout(tmp_path, capsys):
    golden = torch.load(os.path.join(FIXTURE, "golden.pt"), weights_only=True)
    prompts = _prompts(golden)
    direct = _generate(capsys, FIXTURE, prompts)
    ours = str(tmp_path / "ours_tp2_pp2")
    rc, _, err = convert(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                         FIXTURE, "--save-dir", ours, "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "2")
    assert rc == 0, err
    converted = _generate(capsys, ours, prompts)
    assert [r["tokens"] for r in direct] == [r["tokens"] for r in converted]
    for a, b in zip(direct, converted):
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), rtol=0, atol=1e-5)
    # independent of both: Megatron-Core's own fp32 logits for these weights pick the first generated token and
    # give every prompt token's log-probability
    for i, (n, record) in enumerate(zip(PROMPT_LENGTHS, direct)):
        logp = golden["logits"][i % 2].double().log_softmax(-1)  # [s, V]
        assert record["tokens"][0] == int(logp[n - 1].argmax())
        want = logp[torch.arange(n - 1), golden["tokens"][i % 2, 1:n]]  # the record lists log p(t_k | t_<k) from k = 1
        torch.testing.assert_close(torch.tensor(record["logprobs"][:n - 1], dtype=torch.float64), want,
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("fixture,golden_of", [("megatron_gpt_tp2", "megatron_gpt_tp2"),
                                               ("megatron_gpt_dist", "megatron_gpt")])
def test_tp2_release_and_torch_dist_checkpoints_score_as_megatron_core(fixture, golden_of):
    """Megatron-LM's TP=2 ``release`` folder (re-joined to TP=1) and Megatron-Core's ``torch_dist`` folder (the
    legacy fixture's weights saved again): the prompt log-probs are Megatron-Core's own logits'."""
    root = os.path.dirname(FIXTURE)
    golden = torch.load(os.path.join(root, golden_of, "golden.pt"), weights_only=True)
    loaded = load_gpt_for_inference(os.path.join(root, fixture), dtype=torch.float32)
    engine = InferenceEngine(loaded.model, vocab_size=golden["logits"].shape[-1])
    prompts = golden["tokens"].tolist()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=0, logprobs=True, stop_on_eod=False))
    for i, out in enumerate(outs):
        logp = golden["logits"][i].double().log_softmax(-1)  # [s, V]
        want = logp[torch.arange(len(prompts[i]) - 1), golden["tokens"][i, 1:]]
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-4)
