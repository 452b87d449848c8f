"""Llama-family checkpoints (converted from Hugging Face) through generation: ``tools/generate.py`` gives Hugging
Face ``generate``'s greedy tokens; the KV-cached logits under grouped-query attention and RoPE equal full
recomputation with the query groups split over two tensor-parallel ranks and over two pipeline stages."""

import json
import os
import subprocess
import sys

import pytest
import torch

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


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "pp2"])
def test_cached_logits_equal_recomputation_with_split_groups_and_stages(setup, tp):
    tok, models, ckpts = setup
    prompts = [tok.tokenize(p) for p in PROMPTS]
    reference = {"prompts": prompts, "new": NEW, "generated": [_hf_greedy(models["llama"], ids) for ids in prompts]}
    run_distributed(llama_tiny.cached_equals_recomputed, world_size=2, args=(ckpts["llama"], tp, reference))
