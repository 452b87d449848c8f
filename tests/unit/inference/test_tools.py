"""The command-line tools end to end: generate.py, the server script and the interactive client."""

import json
import os
import subprocess
import sys

import pytest

from megatron.core.inference import InferenceEngine, SamplingParams, load_gpt_for_inference
from megatron.core.tokenizer import build_tokenizer
from tests.unit.inference.tiny import MERGES, ROOT, VOCAB, tiny_args, write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    write_checkpoint(path, tiny_args(padded_vocab_size=50304))
    return path


def _engine(ckpt):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    return InferenceEngine(load_gpt_for_inference(ckpt).model, tokenizer=tok)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def test_generate_tool_matches_engine(ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The tower\nA keeper wrote\n")
    cmd = [sys.executable, os.path.join(ROOT, "tools/generate.py"), "--load", ckpt, "--prompt-file", str(prompts),
           "--max-new-tokens", "6", "--top-k", "4", "--seed", "9", "--ignore-eod", "--json", "--logprobs"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    want = _engine(ckpt).generate_text(["The tower", "A keeper wrote"],
                                       SamplingParams(max_new_tokens=6, top_k=4, seed=9, stop_on_eod=False,
                                                      logprobs=True))
    assert [r["text"] for r in records] == [o.text for o in want]
    assert [r["tokens"] for r in records] == [o.generated for o in want]
    assert [r["logprobs"] for r in records] == [o.logprobs for o in want]
    # prompts on stdin, plain text out (--no-cuda-graph: eager decoding steps, the CPU's way anyway)
    proc = subprocess.run(cmd[:3] + [ckpt, "--greedy", "--max-new-tokens", "4", "--no-cuda-graph"],
                          input="The tower\n", capture_output=True, text=True, env=_env(), timeout=300)
    greedy = _engine(ckpt).generate_text(["The tower"], SamplingParams(max_new_tokens=4, greedy=True))[0]
    assert proc.returncode == 0 and proc.stdout == "The tower" + greedy.text + "\n"


def test_generate_tool_errors(ckpt, tmp_path):
    base = [sys.executable, os.path.join(ROOT, "tools/generate.py")]
    proc = subprocess.run(base + ["--load", str(tmp_path / "none"), "--prompt", "x"], capture_output=True,
                          text=True, env=_env(), timeout=300)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = subprocess.run(base + ["--load", ckpt, "--prompt", "x", "--top-p", "2"], capture_output=True, text=True,
                          env=_env(), timeout=300)
    assert proc.returncode == 2 and "--top-p must be in [0, 1]" in proc.stderr


def test_generate_bad_input_lines(tmp_path, capsys):
    """Bad flags and unreadable prompt files: one line naming the flag (and the file)."""
    from tools import generate

    with pytest.raises(SystemExit):
        generate.parse_args(["--load", "x", "--temperature", "-1"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: --temperature must be >= 0, got -1.0")
    args = generate.parse_args(["--load", "x", "--num-layers", "24", "--fp16", "--micro-batch-size", "3",
                                "--no-load-optim", "--tensor-model-parallel-size", "1"])  # Megatron-LM's flags
    assert (args.batch_size, args.num_layers, args.fp16) == (3, 24, True)
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"fine\n\xff\xfe not text\n")
    args = generate.parse_args(["--load", "x", "--prompt-file", str(bad)])
    with pytest.raises(ValueError, match=rf"^--prompt-file {bad}: not UTF-8 text \(byte 0xff on line 2\)$"):
        generate.read_prompts(args)


def test_client_exits_non_zero_when_requests_fail(monkeypatch, capsys):
    """An address with nothing listening ends the client at once with one line and exit status 1."""
    import io
    import socket

    from tools import text_generation_cli

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nworld\n"))
    assert text_generation_cli.main([f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot reach http://127.0.0.1:{port}:")


def test_server_script_and_client(ckpt):
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools/run_text_generation_server.py"),
                               "--load", ckpt, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env())
    try:
        line = server.stdout.readline()
        assert "serving" in line and "http://127.0.0.1:" in line, line + server.stderr.read()
        address = line.strip().rsplit("http://", 1)[1]
        client = subprocess.run([sys.executable, os.path.join(ROOT, "tools/text_generation_cli.py"), address,
                                 "--greedy", "--tokens-to-generate", "5"], input="The tower\n\n",
                                capture_output=True, text=True, env=_env(), timeout=300)
        greedy = _engine(ckpt).generate_text(["The tower"], SamplingParams(max_new_tokens=5, greedy=True))[0]
        assert client.returncode == 0, client.stderr
        assert client.stdout == "The tower" + greedy.text + "\n"
        # a request the server refuses is reported, the next one is served, the exit status says one failed
        client = subprocess.run([sys.executable, os.path.join(ROOT, "tools/text_generation_cli.py"), address,
                                 "--greedy", "--tokens-to-generate", "5", "--seed", "-3"],
                                input="The tower\n\n", capture_output=True, text=True, env=_env(), timeout=300)
        assert client.returncode == 1 and client.stdout == ""
        err = client.stderr.strip().splitlines()
        assert err[0].startswith("error: server answered 400:") and err[1] == "error: 1 of 1 requests failed", err
    finally:
        server.terminate()
        server.wait(timeout=60)


def megatron_server_flags(ckpt, tp):
    """The flag block of Megatron-LM's ``examples/run_text_generation_server_345M.sh`` (and its tensor-parallel
    variant), in its order, with the sizes of our tiny checkpoint."""
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "1", "--num-layers", "2",
            "--hidden-size", "32", "--load", ckpt, "--num-attention-heads", "4", "--max-position-embeddings", "48",
            "--tokenizer-type", "GPT2BPETokenizer", "--fp16", "--micro-batch-size", "1", "--seq-length", "48",
            "--vocab-file", VOCAB, "--merge-file", MERGES, "--seed", "42"]


def test_tensor_parallel_server(ckpt):
    """Two ranks under torchrun, started with Megatron-LM's server flags: rank 0 serves, rank 1 follows; answers
    equal the single-process engine's. The server idles past the process group's (short) timeout and still
    answers: the following rank waits for jobs on a group without that timeout."""
    import socket
    import time
    import urllib.request

    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    timeout_s = 3
    server = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(master_port),
                               os.path.join(ROOT, "tools/run_text_generation_server.py"),
                               *megatron_server_flags(ckpt, 2), "--port", "0",
                               "--distributed-timeout-minutes", str(timeout_s / 60)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        line = server.stdout.readline()
        assert "TP 2 x PP 1" in line, line + server.stderr.read()
        address = line.strip().rsplit("http://", 1)[1]
        time.sleep(2 * timeout_s + 1)  # idle past the timeout
        assert server.poll() is None, server.stderr.read()
        body = {"prompts": ["The tower", "A keeper"], "tokens_to_generate": 5, "temperature": 0.0,
                "logprobs": True}
        req = urllib.request.Request(f"http://{address}/api", data=json.dumps(body).encode(), method="PUT")
        answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
        tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
        engine = InferenceEngine(load_gpt_for_inference(ckpt, dtype=torch.float16).model, tokenizer=tok)
        want = engine.generate_text(body["prompts"], SamplingParams(max_new_tokens=5, greedy=True, logprobs=True))
        assert answer["text"] == [p + o.text for p, o in zip(body["prompts"], want)]
        assert answer["tokens"] == [o.tokens for o in want]
        for got, out in zip(answer["logprobs"], want):
            assert max(abs(a - b) for a, b in zip(got, out.logprobs)) < 2e-2  # fp16, summed in another order
    finally:
        server.terminate()  # torchrun passes SIGTERM to both ranks (and itself exits non-zero, as it does)
        server.wait(timeout=120)


def test_lm_eval_adapter_command_line(capsys):
    """``python -m megatron.core.inference.lm_eval_adapter`` is the command (``lm_eval --model`` cannot find a
    model registered by another module): its help names it, and ``--model`` is refused in one line."""
    from megatron.core.inference import lm_eval_adapter

    assert lm_eval_adapter.main(["--model", "hf"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --model is set to megatron_lite by this module; give the "
                                               "checkpoint with --model_args load=CKPT")
    try:
        lm_eval_adapter.main(["--help"])  # lm_eval's own help follows (and exits) when it is installed
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m megatron.core.inference.lm_eval_adapter --model_args load=CKPT")
    assert "model_args keys: load, iteration" in out
