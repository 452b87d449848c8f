"""lm-evaluation-harness's ``local-completions`` model (any OpenAI-compatible server) against our generation
server: a LAMBADA-style log-likelihood task scores as with the project's own harness backend.

Skipped unless ``lm_eval`` is installed (``pip install lm_eval``, the ``eval`` extra).
"""

import math
import threading

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm_eval[api]: the API models
transformers = pytest.importorskip("transformers")

from megatron.core.inference import InferenceEngine, load_gpt_for_inference  # noqa: E402
from megatron.core.inference.api import Limits  # noqa: E402
from megatron.core.inference.lm_eval_adapter import MegatronLiteLM  # noqa: E402
from megatron.core.inference.server import GenerationService, make_server  # noqa: E402
from megatron.core.tokenizer import build_tokenizer  # noqa: E402
from tests.unit.inference.lm_eval_tasks import PASSAGES, write_loglikelihood_task  # noqa: E402
from tests.unit.inference.tiny import MERGES, VOCAB, tiny_args, write_checkpoint  # noqa: E402



def _task(tmp_path, engine, tok) -> str:
    """A local LAMBADA-style task: the last word given the passage; every other target is the model's own greedy
    next token, so that accuracy is neither 0 nor 1."""
    rows = []
    for i, text in enumerate(PASSAGES):
        head, last = text.rsplit(" ", 1)
        if i % 2 == 0:
            logits = engine.forward_logits(torch.tensor([tok.tokenize(head)]))[0, -1, :tok.vocab_size]
            last = tok.detokenize([int(logits.argmax())])
            rows.append({"context": head, "target": last})
        else:
            rows.append({"context": head, "target": " " + last})
    write_loglikelihood_task(tmp_path / "tasks", "local_last_word", rows)
    return str(tmp_path / "tasks")


def test_local_completions_scores_as_the_adapter(tmp_path, monkeypatch):
    import lm_eval.models.openai_completions  # noqa: F401  (registers local-completions)
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, tiny_args(padded_vocab_size=50304))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    engine = InferenceEngine(load_gpt_for_inference(ckpt).model, tokenizer=tok)
    service = GenerationService(engine, Limits(max_prompts=8, max_positions=engine.max_length), model_name="tiny",
                                log=lambda msg: None)
    server = make_server(service, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    hf_tok = str(tmp_path / "hf-tokenizer")  # the same GPT-2 BPE files, as the harness's tokenizer
    transformers.GPT2TokenizerFast(vocab=VOCAB, merges=MERGES).save_pretrained(hf_tok)
    tasks = TaskManager(include_path=_task(tmp_path, engine, tok))
    try:
        want = lm_eval.simple_evaluate(model=MegatronLiteLM(load=ckpt, batch_size=4, device="cpu"),
                                       tasks=["local_last_word"], task_manager=tasks,
                                       bootstrap_iters=0)["results"]["local_last_word"]
        assert want["acc,none"] == 0.5
        for tokenized in (True, False):  # token-id prompts, then text prompts tokenized by the server
            model_args = (f"model=tiny,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={hf_tok},"
                          f"tokenizer_backend=huggingface,max_length=48,max_retries=1,"
                          f"tokenized_requests={tokenized}")
            got = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                          tasks=["local_last_word"], task_manager=tasks,
                                          bootstrap_iters=0)["results"]
            got = got["local_last_word"]
            assert got["acc,none"] == want["acc,none"], (tokenized, got, want)
            assert math.isclose(got["perplexity,none"], want["perplexity,none"], rel_tol=1e-5), (tokenized, got)
    finally:
        server.shutdown()
        server.server_close()
