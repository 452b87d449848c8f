"""tasks/main.py against an independent re-computation with Hugging Face GPT-2 holding the same weights."""

import json
import math
import os

import pytest
import torch

from megatron.core.inference import InferenceEngine, load_gpt_for_inference
from megatron.core.tokenizer import build_tokenizer
from tasks.main import parse_args, run
from megatron.core.inference.zeroshot_data import lm_windows, wikitext_detokenize
from tests.conftest import SHARED_DATA
from tests.dist_utils import run_distributed
from tests.unit.zeroshot.tp_body import LAMBADA, WIKI, tp2_body
from megatron.core.inference.hf_gpt2 import to_hf_gpt2
from tests.unit.inference.tiny import MERGES, VOCAB, tiny_args, tiny_model, write_checkpoint

pytest.importorskip("transformers")
SEQ = 48


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    args = tiny_args(padded_vocab_size=50304, seq_length=SEQ, max_position_embeddings=SEQ)
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    write_checkpoint(ckpt, args)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    return ckpt, tok, to_hf_gpt2(tiny_model(args))


GPT2_VOCAB = 50257  # the tokenizer's ids: scores leave the embedding's padding rows out


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, :, :GPT2_VOCAB].double()  # [s, V] over the real vocabulary


def reference_wikitext(hf, tok, path, seq, stride):
    """Each target scored once, by the first window (starts 0, stride, 2 stride, ...) that reaches it."""
    raw = open(path, encoding="utf-8").read()
    words = len(raw.strip().split(" "))
    ids = tok.tokenize(wikitext_detokenize(raw))
    total, scored, start = 0.0, 0, 0
    while scored < len(ids) - 1:
        window = ids[start:start + seq + 1]
        logp = _hf_logits(hf, window[:-1]).log_softmax(-1)
        for k in range(len(window) - 1):
            if start + k + 1 > scored:
                total -= float(logp[k, window[k + 1]])
        scored = start + len(window) - 1
        start += stride
    loss = total / (len(ids) - 1)
    ratio = (len(ids) - 1) / (words - 1)
    return {"avg loss": loss, "ppl": math.exp(loss), "adjusted ppl": math.exp(loss * ratio), "token ratio": ratio}


def reference_lambada(hf, tok, path, strict, seq=SEQ):
    """A passage longer than the window keeps its last ``seq + 1`` tokens."""
    correct = total = 0
    for line in open(path, encoding="utf-8"):
        text = json.loads(line)["text"]
        if strict:
            word = text.split()[-1]
            context, target = tok.tokenize(text[:text.rfind(word)].strip()), tok.tokenize(" " + word)
        else:
            ids = tok.tokenize(text)
            context, target = ids[:-1], ids[-1:]
        ids = (context + target)[-(seq + 1):]
        n = min(len(target), len(ids) - 1)
        predicted = _hf_logits(hf, ids[:-1]).argmax(-1)[-n:].tolist()
        correct += int(predicted == target[-n:])
        total += 1
    return correct, total


def _run(ckpt, *extra):
    return run(parse_args(["--load", ckpt, "--micro-batch-size", "4", *extra]))


@pytest.mark.parametrize("stride", [None, 16])
def test_wikitext_equals_reference(setup, stride, tmp_path):
    ckpt, tok, hf = setup
    extra = ["--overlapping-eval", str(stride)] if stride else []
    got = _run(ckpt, "--task", "WIKITEXT103", "--valid-data", WIKI, "--results-file", str(tmp_path / "r.json"),
               *extra)
    want = reference_wikitext(hf, tok, WIKI, SEQ, stride or SEQ)
    assert abs(got["avg loss"] - want["avg loss"]) < 1e-4
    for key in ("ppl", "adjusted ppl"):
        assert abs(got[key] - want[key]) <= 1e-4 * want[key]
    assert got["token ratio"] == want["token ratio"] and got["token ratio"] != 1.0
    assert json.load(open(tmp_path / "r.json"))["avg loss"] == got["avg loss"]


def _word_tokens(tok) -> torch.Tensor:
    """Mask over the vocabulary of the tokens that are a whole word with its leading space (" cat")."""
    mask = torch.zeros(tok.vocab_size, dtype=torch.bool)
    for i in range(tok.vocab_size):
        text = tok.detokenize([i])
        mask[i] = len(text) > 2 and text[0] == " " and text[1:].isalpha() and text[1:].isascii()
    return mask


def lambada_with_model_endings(ckpt, tok, out_path, whole_words=True):
    """The fixture passages, every other one ending in what the model itself predicts next, so that accuracy is
    neither 0 nor 1: its most likely whole-word token (right under --strict-lambada too when that is also its
    argmax), or with ``whole_words=False`` its argmax token whatever it is (a barely trained model's is a
    newline or a punctuation mark)."""
    engine = InferenceEngine(load_gpt_for_inference(ckpt).model, tokenizer=tok)
    words = _word_tokens(tok) if whole_words else torch.ones(tok.vocab_size, dtype=torch.bool)
    lines = [json.loads(line)["text"] for line in open(LAMBADA, encoding="utf-8")]
    with open(out_path, "w") as f:
        for i, text in enumerate(lines):
            if i % 2 == 0:
                context = text[:text.rfind(text.split()[-1])].rstrip()
                ids = tok.tokenize(context)[-engine.model.config.seq_length:]  # the window tasks/main.py scores
                logits = engine.forward_logits(torch.tensor([ids]))[0, -1, :tok.vocab_size]  # [V]
                best = int(logits.masked_fill(~words, float("-inf")).argmax())
                text = context + tok.detokenize([best])
            f.write(json.dumps({"text": text}) + "\n")
    return out_path


@pytest.mark.parametrize("strict", [False, True])
def test_lambada_equals_reference(setup, strict, tmp_path):
    ckpt, tok, hf = setup
    data = str(tmp_path / "lambada.jsonl")
    lambada_with_model_endings(ckpt, tok, data)
    got = _run(ckpt, "--task", "LAMBADA", "--valid-data", data, *(["--strict-lambada"] if strict else []))
    correct, total = reference_lambada(hf, tok, data, strict)
    assert (got["number correct"], got["total examples"]) == (correct, total)
    assert 0 < correct < total


def test_detokenizer_rules():
    raw = ' = = Title = = \n A 1 @,@ 000 @-@ year ( old ) " quoted " thing , it \'s 3 @.@ 5 ° C . \n'
    assert wikitext_detokenize(raw) == ' == Title ==\nA 1,000-year (old) "quoted" thing, it\'s 3.5°C.\n'


def test_windows_count_every_target_once():
    tokens = list(range(101))
    for seq, stride in ((16, 16), (16, 5), (16, 1), (200, 50)):
        samples = lm_windows(tokens, seq, pad=-1, overlapping_eval=stride)
        counted = sorted(t for i, (window, mask) in enumerate(samples)
                         for t, m in zip(window[1:], mask) if m)
        assert counted == tokens[1:], (seq, stride)


def test_bad_inputs(setup, tmp_path):
    ckpt, _, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine passage here"}\n{"txt": 1}\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object with a 'text' string"):
        _run(ckpt, "--task", "LAMBADA", "--valid-data", str(bad))
    bad.write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
    for task in ("LAMBADA", "WIKITEXT103"):
        with pytest.raises(ValueError, match=rf"^--valid-data {bad}: not UTF-8 text \(byte 0xff on line 2\)$"):
            _run(ckpt, "--task", task, "--valid-data", str(bad))
    with pytest.raises(SystemExit):
        parse_args(["--load", ckpt, "--task", "LAMBADA", "--valid-data", str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="--seq-length 64 exceeds the checkpoint's 48 positions"):
        _run(ckpt, "--task", "WIKITEXT103", "--valid-data", WIKI, "--seq-length", "64")


def megatron_zeroshot_flags(ckpt, valid_data):
    """The flag block of Megatron-LM's ``examples/evaluate_zeroshot_gpt.sh``, in its order, with the sizes of our
    tiny checkpoint (``--batch-size`` is its older name of ``--micro-batch-size``)."""
    return ["--task", "LAMBADA", "--valid-data", valid_data, "--tokenizer-type", "GPT2BPETokenizer",
            "--strict-lambada", "--vocab-file", VOCAB, "--merge-file", MERGES, "--load", ckpt,
            "--tensor-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--batch-size", "8", "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--log-interval", "10", "--fp16", "--no-load-optim",
            "--no-load-rng"]


def test_megatron_zeroshot_script_flags(setup, tmp_path):
    """Megatron-LM's evaluation script's command (``python -m torch.distributed.launch``, which adds
    ``--local-rank``) runs unchanged but for the sizes, scores in fp16 as our own flags do, and each model flag is
    checked against the checkpoint: a mismatch is one line naming the flag, the value given and the stored one."""
    import subprocess
    import sys

    from tests.unit.inference.tiny import ROOT

    ckpt, tok, _ = setup
    data = lambada_with_model_endings(ckpt, tok, str(tmp_path / "lambada.jsonl"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "1",
                           "--master_port", "0", os.path.join(ROOT, "tasks/main.py"),
                           *megatron_zeroshot_flags(ckpt, data), "--results-file", str(tmp_path / "r.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: --batch-size is Megatron-LM's old name of --micro-batch-size" in proc.stderr
    got = json.load(open(tmp_path / "r.json"))
    want = _run(ckpt, "--task", "LAMBADA", "--valid-data", data, "--strict-lambada", "--dtype", "fp16")
    assert got["number correct"] == want["number correct"] and got["total examples"] == want["total examples"]
    assert 0 < got["number correct"] < got["total examples"]
    flags = megatron_zeroshot_flags(ckpt, data)
    for flag, value, stored in (("--num-layers", "24", "2"), ("--hidden-size", "1024", "32"),
                                ("--max-position-embeddings", "1024", "48")):
        bad = list(flags)
        bad[bad.index(flag) + 1] = value
        with pytest.raises(ValueError, match=rf"^--load {ckpt} \(.*\) does not match: {flag} {value} \(the "
                                             rf"checkpoint's is {stored}\)$"):
            run(parse_args(bad))
    bad = list(flags)
    bad[bad.index("--tensor-model-parallel-size") + 1] = "2"
    with pytest.raises(ValueError, match=r"^--tensor-model-parallel-size 2 must equal the number of processes"):
        run(parse_args(bad))
    with pytest.raises(ValueError, match=r"^conflicting parameter dtypes: --fp16, --bf16$"):
        run(parse_args(flags + ["--bf16"]))


def test_tp2_and_pp2_equal_tp1(setup, tmp_path):
    ckpt, tok, _ = setup
    out = str(tmp_path / "tp2.json")
    lambada = lambada_with_model_endings(ckpt, tok, str(tmp_path / "lambada.jsonl"))
    run_distributed(tp2_body, world_size=2, args=(ckpt, out, lambada))
    wiki1 = _run(ckpt, "--task", "WIKITEXT103", "--valid-data", WIKI)
    lambada1 = _run(ckpt, "--task", "LAMBADA", "--valid-data", lambada)
    assert 0 < lambada1["number correct"] < lambada1["total examples"]
    results = json.load(open(out))
    for wiki2, lambada2 in (results[:2], results[2:]):  # TP=2, then PP=2
        assert abs(wiki1["avg loss"] - wiki2["avg loss"]) < 1e-5
        assert lambada1["number correct"] == lambada2["number correct"]


EVAL = os.path.join(SHARED_DATA, "eval")


@pytest.mark.skipif(not os.path.isdir(EVAL), reason=f"{EVAL} not present (real WikiText/LAMBADA files)")
def test_real_files_equal_reference(setup, tmp_path):
    """The first part of the real test files (the full files take minutes even with a tiny model)."""
    ckpt, tok, hf = setup
    wiki = tmp_path / "wiki.raw"
    wiki.write_text("".join(open(os.path.join(EVAL, "wikitext-test.raw"), encoding="utf-8").readlines()[:8]))
    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(open(os.path.join(EVAL, "lambada_test.jsonl"), encoding="utf-8").readlines()[:12]))
    got = _run(ckpt, "--task", "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", "32")
    want = reference_wikitext(hf, tok, str(wiki), SEQ, 32)
    assert abs(got["avg loss"] - want["avg loss"]) < 1e-4
    assert got["token ratio"] == want["token ratio"]
    for strict in (False, True):
        got = _run(ckpt, "--task", "LAMBADA", "--valid-data", str(lam), *(["--strict-lambada"] if strict else []))
        assert got["number correct"] == reference_lambada(hf, tok, str(lam), strict)[0]
