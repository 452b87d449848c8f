"""Llama-family checkpoints (converted from Hugging Face) through generation: ``tools/generate.py`` gives Hugging
Face ``generate``'s greedy tokens; the KV-cached logits under grouped-query attention and RoPE equal full
recomputation with the query groups split over two tensor-parallel ranks and over two pipeline stages."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference import InferenceEngine, SamplingParams, load_gpt_for_inference
from megatron.core.parallel_state import ParallelState
from megatron.core.tokenizer import build_tokenizer
from tests.dist_utils import run_distributed
from tests.unit.inference import llama_tiny
from tests.unit.inference.tiny import ROOT

pytest.importorskip("transformers")

PROMPTS = ["the king of love and sorrow", "she was fair ; he"]
NEW = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    tok_dir = llama_tiny.write_tokenizer(str(d / "tokenizer"))
    models, ckpts = {}, {}
    for kind in ("llama", "qwen2"):
        models[kind] = llama_tiny.hf_model(kind)
        ckpts[kind] = llama_tiny.write_checkpoint(kind, models[kind], str(d / kind), tok_dir)
    return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_dir), models, ckpts


def _hf_greedy(hf, ids):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generate_tool_equals_hugging_face_generate(setup, kind):
    tok, models, ckpts = setup
    cmd = [sys.executable, os.path.join(ROOT, "tools/generate.py"), "--load", ckpts[kind], "--greedy",
           "--max-new-tokens", str(NEW), "--ignore-eod", "--json"]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    for prompt, record in zip(PROMPTS, records, strict=True):
        ids = tok.tokenize(prompt)
        assert ids[0] == tok.bos  # the tokenizer's template puts BOS first, as Hugging Face's does
        assert record["tokens"] == _hf_greedy(models[kind], ids)


def _parallel_body(rank, world_size, ckpt, tp, reference):
    pstate = ParallelState.build(tensor_model_parallel_size=tp, pipeline_model_parallel_size=world_size // tp)
    model = load_gpt_for_inference(ckpt, pstate).model
    attention = model.decoder.layers[0].self_attention
    assert attention.groups_per_rank == 2 // tp  # tensor parallelism splits the query groups
    tok_ids = reference["prompts"]
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True, stop_on_eod=False, logprobs=True)
    for static in (True, False):
        engine = InferenceEngine(model, pstate, eod=1, static_decode=static)
        outs = engine.generate(tok_ids, greedy)
        assert [o.generated for o in outs] == reference["generated"]
        # every cached log-prob (prompt pass and decoding steps) against one uncached forward over the sequences
        n = min(len(o.tokens) for o in outs)
        tokens = torch.tensor([o.tokens[:n] for o in outs])
        logits = engine.forward_logits(tokens)
        if logits is not None:
            full = F.log_softmax(logits[:, :-1, :engine.vocab_size], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
            cached = torch.tensor([o.logprobs[:n - 1] for o in outs])
            torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "pp2"])
def test_cached_logits_equal_recomputation_with_split_groups_and_stages(setup, tp):
    tok, models, ckpts = setup
    prompts = [tok.tokenize(p) for p in PROMPTS]
    reference = {"prompts": prompts, "generated": [_hf_greedy(models["llama"], ids) for ids in prompts]}
    run_distributed(_parallel_body, world_size=2, args=(ckpts["llama"], tp, reference))
