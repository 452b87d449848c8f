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


def test_server_and_zero_shot_run_a_llama_checkpoint(setup, tmp_path):
    """The Megatron-style server (``add_BOS`` starts from the tokenizer's BOS, once) and ``tasks/main.py``'s
    WikiText loss and strict LAMBADA accuracy against Hugging Face's model."""
    import http.client
    import threading

    from megatron.core.inference import InferenceEngine, load_gpt_for_inference
    from megatron.core.inference.api import Limits
    from megatron.core.inference.server import GenerationService, make_server
    from tasks.main import parse_args, run

    tok, models, ckpts = setup
    hf = models["llama"]
    engine = InferenceEngine(load_gpt_for_inference(ckpts["llama"]).model, tokenizer=tok)
    service = GenerationService(engine, Limits(max_prompts=4, max_positions=engine.max_length), model_name="llama",
                                log=lambda msg: None)
    server = make_server(service, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
        body = {"prompts": [PROMPTS[0]], "tokens_to_generate": NEW, "temperature": 0.0, "add_BOS": True}
        conn.request("PUT", "/api", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == 200, answer
    finally:
        server.shutdown()
        server.server_close()
    ids = tok.tokenize(PROMPTS[0])
    assert ids.count(tok.bos) == 1 and ids[0] == tok.bos  # the prompt holds BOS once, first
    assert answer["segments"][0] == [tok.detokenize([t]) for t in ids + _hf_greedy(hf, ids)]

    # WikiText: one window over the whole text; loss per target against Hugging Face's
    words = llama_tiny.WORDS[:-6]  # no punctuation: the WikiText detokenizer would glue it to the words
    text = " ".join(words[(7 * i) % len(words)] for i in range(40))
    wiki = tmp_path / "wiki.txt"
    wiki.write_text(text + " \n")
    got = run(parse_args(["--load", ckpts["llama"], "--task", "WIKITEXT103", "--valid-data", str(wiki)]))
    ids = tok.tokenize(text)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1]
    want_loss = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])))
    assert abs(got["avg loss"] - want_loss) < 1e-5

    # strict LAMBADA: passages ending in Hugging Face's next word (right) or in another word (wrong)
    lines, expected = [], 0
    for i in range(6):
        context = " ".join(words[(5 * i + j) % len(words)] for j in range(8))
        with torch.no_grad():
            best = int(hf(torch.tensor([tok.tokenize(context)])).logits[0, -1].argmax())
        word = tok.detokenize([best]) if i % 2 == 0 else "sorrow"
        expected += int(tok.tokenize(context + " " + word)[-1] == best)
        lines.append(json.dumps({"text": context + " " + word}))
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("\n".join(lines) + "\n")
    got = run(parse_args(["--load", ckpts["llama"], "--task", "LAMBADA", "--valid-data", str(lambada),
                          "--strict-lambada"]))
    assert (got["number correct"], got["total examples"]) == (expected, 6) and expected >= 3
