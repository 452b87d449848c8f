"""The generation server on loopback: valid answers, a table of malformed requests, concurrent clients."""

import http.client
import json
import socket
import threading

import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.inference.api import Limits
from megatron.core.inference.server import GenerationService, make_server
from megatron.core.tokenizer import build_tokenizer
from tests.unit.inference.tiny import MERGES, VOCAB, tiny_args, tiny_model

MAX_BODY = 1 << 18  # holds JSON nested 100,000 deep


@pytest.fixture(scope="module")
def served():
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    engine = InferenceEngine(tiny_model(tiny_args(padded_vocab_size=50304)), tokenizer=tok)
    service = GenerationService(engine, Limits(max_prompts=8, max_positions=engine.max_length), model_name="tiny",
                                log=lambda msg: None)
    server = make_server(service, "127.0.0.1", 0, max_body_bytes=MAX_BODY)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield engine, server.server_address[1]
    server.shutdown()
    server.server_close()


def request(port, method, path, body=None, raw=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    status, payload = resp.status, json.loads(resp.read())
    conn.close()
    return status, payload


def expected_megatron(engine, prompts, n, **kw):
    outs = engine.generate_text(prompts, SamplingParams(max_new_tokens=n, **kw))
    return [p + o.text for p, o in zip(prompts, outs)], outs


def test_health_and_valid_requests(served):
    engine, port = served
    status, health = request(port, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == "tiny"
    status, ans = request(port, "PUT", "/api", {"prompts": ["Hello there", "A"], "tokens_to_generate": 6,
                                                "temperature": 0.0, "logprobs": True})
    assert status == 200
    texts, outs = expected_megatron(engine, ["Hello there", "A"], 6, greedy=True, logprobs=True)
    assert ans["text"] == texts
    assert ans["logprobs"] == [o.logprobs for o in outs]
    assert ans["tokens"] == [o.tokens for o in outs]  # prompt and generated ids, as Megatron-LM's server
    assert ans["segments"][0][:2] == ["Hello", " there"]
    status, ans = request(port, "PUT", "/api", {"prompts": ["Once"], "tokens_to_generate": 5, "top_k": 5,
                                                "random_seed": 3})
    assert status == 200
    assert ans["text"] == expected_megatron(engine, ["Once"], 5, top_k=5, seed=3)[0]
    status, ans = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 4,
                                                           "temperature": 0, "logprobs": 2})
    assert status == 200
    out = engine.generate_text(["Once"], SamplingParams(max_new_tokens=4, greedy=True, logprobs=True))[0]
    choice = ans["choices"][0]
    assert choice["text"] == out.text and choice["finish_reason"] in ("length", "stop")
    assert choice["logprobs"]["token_logprobs"] == out.logprobs[-len(out.generated):]
    assert all(len(t) <= 2 for t in choice["logprobs"]["top_logprobs"])
    assert ans["usage"] == {"prompt_tokens": 1, "completion_tokens": len(out.generated),
                            "total_tokens": 1 + len(out.generated)}
    # echo with no new tokens scores the prompt
    status, ans = request(port, "POST", "/v1/completions", {"prompt": "The keeper lived here", "max_tokens": 0,
                                                           "echo": True, "logprobs": 0})
    scored = engine.generate_text(["The keeper lived here"], SamplingParams(max_new_tokens=0, logprobs=True))[0]
    choice = ans["choices"][0]
    assert status == 200 and choice["text"] == "The keeper lived here"
    assert choice["logprobs"]["token_logprobs"] == [None] + scored.logprobs
    assert "".join(choice["logprobs"]["tokens"]) == "The keeper lived here"
    assert choice["logprobs"]["text_offset"] == [0, 3, 10, 16]


def test_token_prompts_echo_top_logprobs_and_models(served):
    """What lm-evaluation-harness's ``local-completions`` sends and reads: token-id prompts, and with echo plus
    logprobs a most-likely-token object at every position but the first (None there, as in OpenAI's API)."""
    engine, port = served
    status, models = request(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"] and models["object"] == "list"
    ids = [engine.tokenizer.tokenize(t) for t in ("The keeper lived here", "A storm")]
    status, ans = request(port, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0,
                                                           "echo": True, "logprobs": 2})
    assert status == 200, ans
    for prompt, choice in zip(ids, ans["choices"]):
        full = engine.generate([prompt], SamplingParams(max_new_tokens=1, greedy=True, logprobs=True))[0].tokens
        logits = engine.forward_logits(torch.tensor([full]))[0, :, :engine.vocab_size].log_softmax(-1)  # [s, V]
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["top_logprobs"]) == len(full)
        for pos in range(1, len(full)):
            want = torch.topk(logits[pos - 1], 2)
            got = lp["top_logprobs"][pos]
            assert list(got) == [engine.tokenizer.detokenize([t]) for t in want.indices.tolist()], pos
            assert max(abs(a - b) for a, b in zip(got.values(), want.values.tolist())) < 1e-5
            assert abs(lp["token_logprobs"][pos] - float(logits[pos - 1, full[pos]])) < 1e-5
        assert choice["text"] == engine.tokenizer.detokenize(full)
    # a single token-id prompt (a flat list) is one prompt
    status, ans = request(port, "POST", "/v1/completions", {"prompt": ids[1], "max_tokens": 2, "temperature": 0})
    assert status == 200 and len(ans["choices"]) == 1 and ans["usage"]["prompt_tokens"] == len(ids[1])


def megatron_cli_reads(port, body):
    """How Megatron-LM's ``tools/text_generation_cli.py`` reads an answer (it is a script of its repository, not an
    installable package): ``requests.put`` to ``/api``; on a status other than 200 it prints
    ``response.json()['message']``, otherwise ``response.json()['text'][0]``."""
    import requests

    response = requests.put(f"http://127.0.0.1:{port}/api", data=json.dumps(body),
                            headers={"Content-Type": "application/json"}, timeout=60)
    if response.status_code != 200:
        return f"Error {response.status_code}: {response.json()['message']}"
    return response.json()["text"][0]


def test_megatron_cli_reads_our_answers(served):
    _, port = served
    assert megatron_cli_reads(port, {"prompts": ["Still"], "tokens_to_generate": 2}).startswith("Still")
    assert (megatron_cli_reads(port, {"prompts": ["Still"], "tokens_to_generate": "x"})
            == "Error 400: tokens_to_generate must be an integer, got str")


DEEP = b"[" * 100_000 + b"]" * 100_000
MALFORMED = [
    ("PUT", "/api", None, b"{not json", 400, "invalid JSON"),
    ("PUT", "/api", None, DEEP, 400, "nested too deeply"),
    ("PUT", "/api", None, b'{"prompts": ' + DEEP[:4000] + DEEP[-4000:] + b'}', 400, "nested too deeply"),
    ("PUT", "/api", None, b'{"prompts": ["\\ud800"]}', 400, "lone surrogate"),
    ("POST", "/v1/completions", None, b'{"prompt": "a", "stop": ["x\\udfff"]}', 400, "lone surrogate"),
    ("POST", "/v1/completions", None, b'{"prompt": "a", "\\udc00": 1}', 400, "lone surrogate"),
    ("PUT", "/api", None, b'"a string"', 400, "JSON object, got str"),
    ("PUT", "/api", None, b"null", 400, "JSON object, got NoneType"),
    ("POST", "/v1/completions", None, b"3.5", 400, "JSON object, got float"),
    ("PUT", "/api", None, b'{"prompts": ["a"], "random_seed": 1' + b"0" * 5000 + b"}", 400, "invalid JSON"),
    ("PUT", "/api", {"prompts": {"a": 1}}, None, 400, "non-empty list"),
    ("PUT", "/api", {"prompts": ["a"], "stop_on_eol": "yes"}, None, 400, "true or false"),
    ("POST", "/v1/completions", {"prompt": [[]]}, None, 400, "empty list of token ids"),
    ("POST", "/v1/completions", {"prompt": [[1, 50257]]}, None, 400, r"token id 50257, outside"),
    ("POST", "/v1/completions", {"prompt": [1, "a"]}, None, 400, r"prompt\[0\] must be a string"),
    ("POST", "/v1/completions", {"prompt": [list(range(40))], "max_tokens": 9}, None, 400, "exceeds the model's"),
    ("POST", "/v1/models", {}, None, 405, "use GET"),
    ("PUT", "/api", [1, 2], None, 400, "JSON object"),
    ("PUT", "/api", {"tokens_to_generate": 4}, None, 400, "prompts is required"),
    ("PUT", "/api", {"prompts": 5}, None, 400, "non-empty list"),
    ("PUT", "/api", {"prompts": []}, None, 400, "non-empty list"),
    ("PUT", "/api", {"prompts": [1]}, None, 400, r"prompts\[0\] must be a string"),
    ("PUT", "/api", {"prompts": [""], "tokens_to_generate": 4}, None, 400, "empty"),
    ("PUT", "/api", {"prompts": ["a"] * 9}, None, 400, "too many prompts"),
    ("PUT", "/api", {"prompts": ["a"], "tokens_to_generate": -1}, None, 400, "tokens_to_generate must be in"),
    ("PUT", "/api", {"prompts": ["a"], "tokens_to_generate": 10**12}, None, 400, "tokens_to_generate must be in"),
    ("PUT", "/api", {"prompts": ["a"], "tokens_to_generate": "5"}, None, 400, "must be an integer"),
    ("PUT", "/api", {"prompts": ["a"], "tokens_to_generate": True}, None, 400, "must be an integer"),
    ("PUT", "/api", {"prompts": ["a"], "tokens_to_generate": 0}, None, 400, "logprobs"),
    ("PUT", "/api", {"prompts": ["a"], "temperature": -0.5}, None, 400, "temperature must be in"),
    ("PUT", "/api", None, b'{"prompts": ["a"], "temperature": NaN}', 400, "not a number"),
    ("PUT", "/api", {"prompts": ["a"], "top_k": 2.5}, None, 400, "top_k must be an integer"),
    ("PUT", "/api", {"prompts": ["a"], "top_p": 1.5}, None, 400, "top_p must be in"),
    ("PUT", "/api", {"prompts": ["a"], "top_k": 5, "top_p": 0.5}, None, 400, "not both"),
    ("PUT", "/api", {"prompts": ["a"], "random_seed": -1}, None, 400, "random_seed must be in"),
    ("PUT", "/api", {"prompts": ["a"], "logprobs": "yes"}, None, 400, "true or false"),
    ("PUT", "/api", {"prompts": ["a"], "colour": "red"}, None, 400, "unknown field"),
    ("PUT", "/api", {"prompts": ["a"], "beam_width": 2}, None, 400, "beam search"),
    ("PUT", "/api", {"prompts": ["word " * 60], "tokens_to_generate": 4}, None, 400, "exceeds the model's 48"),
    ("PUT", "/api", {"prompts": ["a" * MAX_BODY]}, None, 413, "exceeds the limit"),
    ("PUT", "/api", None, b'{"prompts": ["\xff"]}', 400, "not UTF-8"),
    ("GET", "/api", None, None, 405, "no such endpoint"),
    ("POST", "/nowhere", {"prompts": ["a"]}, None, 404, "no such endpoint"),
    ("POST", "/v1/completions", {"prompt": "a", "n": 2}, None, 400, "n must be"),
    ("POST", "/v1/completions", {"prompt": "a", "stream": True}, None, 400, "stream"),
    ("POST", "/v1/completions", {"prompt": "a", "logprobs": 6}, None, 400, "logprobs must be in"),
    ("POST", "/v1/completions", {"prompt": "a", "stop": [""]}, None, 400, "stop must be"),
    ("POST", "/v1/completions", {"max_tokens": 3}, None, 400, "prompt is required"),
]


@pytest.mark.parametrize("method,path,body,raw,status,message", MALFORMED,
                         ids=[f"{i}-{m[-1][:20]}" for i, m in enumerate(MALFORMED)])
def test_malformed_request_gets_4xx_and_server_keeps_serving(served, method, path, body, raw, status, message):
    import re

    _, port = served
    got, payload = request(port, method, path, body=body, raw=raw)
    assert got == status, payload
    assert re.search(message, payload["error"]["message"]), payload
    ok, ans = request(port, "PUT", "/api", {"prompts": ["Still"], "tokens_to_generate": 2, "temperature": 0})
    assert ok == 200 and ans["text"][0].startswith("Still")


def test_missing_length_and_stalled_client(served):
    _, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest("PUT", "/api")
    conn.putheader("Content-Type", "application/json")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["error"]["message"]
    conn.close()
    # a client that sends half its body and stalls holds only its own thread
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.sendall(b"PUT /api HTTP/1.0\r\nContent-Length: 100\r\n\r\n{\"prompts\"")
    status, _ = request(port, "PUT", "/api", {"prompts": ["ok"], "tokens_to_generate": 2, "temperature": 0})
    stalled.close()
    assert status == 200


def test_concurrent_clients_get_their_own_answers(served):
    engine, port = served
    clients, per_client = 8, 20
    jobs = {}
    for c in range(clients):
        for r in range(per_client):
            prompt = f"Client {c} request {r}:"
            if (c + r) % 2:
                jobs[(c, r)] = ({"prompts": [prompt], "tokens_to_generate": 3, "temperature": 0.0},
                                dict(greedy=True))
            else:
                jobs[(c, r)] = ({"prompts": [prompt], "tokens_to_generate": 3, "top_k": 10, "random_seed": c * 100 + r},
                                dict(top_k=10, seed=c * 100 + r))
    want = {key: expected_megatron(engine, body["prompts"], 3, **kw)[0] for key, (body, kw) in jobs.items()}
    got, errors = {}, []

    def client(c):
        try:
            for r in range(per_client):
                status, ans = request(port, "PUT", "/api", jobs[(c, r)][0])
                got[(c, r)] = (status, ans.get("text"))
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(got) == clients * per_client
    for key, (status, text) in got.items():
        assert status == 200 and text == want[key], key
