"""The lm-evaluation-harness backend on local tasks, against Hugging Face GPT-2 holding the same weights.

Skipped unless ``lm_eval`` is installed (``pip install lm_eval``, the ``eval`` extra).
"""

import json
import math
import textwrap

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from megatron.core.inference.hf_gpt2 import to_hf_gpt2  # noqa: E402
from megatron.core.inference.lm_eval_adapter import MegatronLiteLM  # noqa: E402
from megatron.core.tokenizer import build_tokenizer  # noqa: E402
from tests.unit.inference.lm_eval_tasks import PASSAGES, write_loglikelihood_task  # noqa: E402
from tests.unit.inference.tiny import MERGES, VOCAB, tiny_args, tiny_model, write_checkpoint  # noqa: E402

HF_VOCAB = json.load(open(VOCAB))


def _hf_loglikelihood(hf, ctx, tgt):
    ids = torch.tensor([ctx + tgt])
    with torch.no_grad():
        # over the real vocabulary (the model keeps its padding rows)
        logp = hf(ids[:, :-1]).logits[0, :, :len(HF_VOCAB)].double().log_softmax(-1)  # [s, V]
    rows = logp[len(ctx) - 1:]
    target = torch.tensor(tgt)
    return float(rows.gather(-1, target.unsqueeze(-1)).sum()), bool((rows.argmax(-1) == target).all())


def _hf_greedy(hf, ctx, n, tok):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ctx]), attention_mask=torch.ones(1, len(ctx), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return tok.detokenize(out[0, len(ctx):].tolist()).split("\n")[0]


def test_local_tasks_equal_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = tiny_args(padded_vocab_size=50304)
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, args)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    hf = to_hf_gpt2(tiny_model(args))
    lm = MegatronLiteLM(load=ckpt, batch_size=4, device="cpu")

    # a loglikelihood task: the passage's last word given the rest
    docs = []
    for text in PASSAGES:
        head, last = text.rsplit(" ", 1)
        docs.append({"context": head, "target": " " + last})
    # a generation task: half of the answers are the HF model's own greedy continuation
    gen_docs = []
    for i, text in enumerate(PASSAGES):
        answer = _hf_greedy(hf, tok.tokenize(text), 4, tok) if i % 2 == 0 else " no such answer"
        gen_docs.append({"context": text, "answer": answer})
    write_loglikelihood_task(tmp_path / "tasks", "local_last_word", docs)
    with open(tmp_path / "gen.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in gen_docs)
    (tmp_path / "tasks" / "gen.yaml").write_text(textwrap.dedent(f"""\
        task: local_continue
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tmp_path / 'gen.jsonl'}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{context}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 4
          do_sample: false
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        """))
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=lm, tasks=["local_last_word", "local_continue"],
                                      task_manager=TaskManager(include_path=str(tmp_path / "tasks")))["results"]
    refs = [_hf_loglikelihood(hf, tok.tokenize(d["context"]), tok.tokenize(d["target"])) for d in docs]
    ppl = math.exp(-sum(lp for lp, _ in refs) / len(refs))
    acc = sum(g for _, g in refs) / len(refs)
    got = results["local_last_word"]
    assert abs(got["perplexity,none"] - ppl) <= 1e-4 * ppl
    assert got["acc,none"] == acc
    assert results["local_continue"]["exact_match,none"] == 0.5

    # the requests directly, rolling log-likelihood included
    from lm_eval.api.instance import Instance

    text = PASSAGES[0] + ". " + PASSAGES[1]
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    ids = tok.tokenize(text)
    want = _hf_loglikelihood(hf, [tok.eod], ids)[0]
    assert abs(rolling - want) < 1e-4


def test_model_args_are_checked(tmp_path, capsys):
    """An unknown --model_args key is refused with the accepted ones listed; the module's command line runs the
    harness with the model registered."""
    from megatron.core.inference import lm_eval_adapter

    with pytest.raises(ValueError, match=r"unknown key lod; accepted: load, iteration, batch_size"):
        MegatronLiteLM(lod="x")
    with pytest.raises(ValueError, match="load=CKPT .* is required"):
        MegatronLiteLM()
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, tiny_args(padded_vocab_size=50304))
    (tmp_path / "x.jsonl").write_text(json.dumps({"context": "The tower", "target": " was"}) + "\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "x.yaml").write_text(textwrap.dedent(f"""\
        task: local_x
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tmp_path / 'x.jsonl'}
        test_split: test
        output_type: loglikelihood
        doc_to_text: "{{{{context}}}}"
        doc_to_target: "{{{{target}}}}"
        metric_list:
          - metric: acc
        """))
    assert lm_eval_adapter.main(["--model_args", f"load={ckpt},bogus=1", "--tasks", "local_x",
                                 "--include_path", str(tmp_path / "tasks")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --model_args: unknown key bogus; accepted: load,"), err
    assert lm_eval_adapter.main(["--model_args", f"load={ckpt},device=cpu", "--tasks", "local_x",
                                 "--include_path", str(tmp_path / "tasks"), "--batch_size", "2"]) == 0
    table = capsys.readouterr().out
    assert "megatron_lite (" in table and "load" in table and "|local_x|" in table.replace(" ", "")
