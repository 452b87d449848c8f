"""``--eval-tasks`` during training: the in-loop scores equal ``tasks/main.py`` on the checkpoint saved at the same
iteration (TP=1, TP=2 with sequence parallelism, DP=2, PP=2 interleaved), and a run with the tasks has
bit-identical training losses to one without (dropout on)."""

import json
import os
import re

import pytest
import torch

import pretrain_gpt
from megatron.core.inference import InferenceEngine, load_gpt_for_inference
from megatron.core.tokenizer import build_tokenizer
from megatron.training.arguments import parse_namespace
from megatron.training.flag_table import ConfigError
from tasks.main import parse_args, run
from tests.dist_utils import run_distributed
from tests.functional.harness import gpt_args
from tests.unit.inference.tiny import MERGES, VOCAB
from tests.unit.zeroshot.tp_body import LAMBADA, WIKI

STRIDE = "8"
VALID = re.compile(r"validation loss at iteration (\d+) \| lambada acc value: (\S+) \| wikitext ppl value: (\S+) \| "
                   r"wikitext adjusted ppl value: (\S+) \|")


def _args(**kw):
    """A tiny GPT on random tokens (dropout on), evaluated every 2 of 4 iterations with no validation loss."""
    opts = dict(mock_data=True, data_path=None, num_layers=2, hidden_size=32, global_batch_size=4, train_iters=4,
                eval_interval=2, attention_dropout=0.1, hidden_dropout=0.1, init_method_std=0.3)
    opts.update(kw)
    return gpt_args("", **opts)


def _tasks(lambada, *extra):
    return ["--eval-tasks", "lambada,wikitext", "--eval-lambada-data", lambada, "--eval-wikitext-data", WIKI,
            "--eval-overlapping-eval", STRIDE, *extra]


def _reference(ckpt, iteration, lambada):
    """tasks/main.py on the checkpoint (single process, the trainer's attention kernel)."""
    common = ["--load", ckpt, "--iteration", str(iteration), "--attention-backend", "unfused"]
    wiki = run(parse_args(common + ["--task", "WIKITEXT103", "--valid-data", WIKI, "--overlapping-eval", STRIDE]))
    lam = run(parse_args(common + ["--task", "LAMBADA", "--valid-data", lambada]))
    return {"lambada acc": lam["avg accuracy"], "wikitext ppl": wiki["ppl"],
            "wikitext adjusted ppl": wiki["adjusted ppl"]}


def _assert_equal_scores(in_loop, reference, what):
    assert in_loop["lambada acc"] == reference["lambada acc"], what
    for key in ("wikitext ppl", "wikitext adjusted ppl"):
        assert abs(in_loop[key] - reference[key]) <= 1e-5 * reference[key], (what, key, in_loop[key], reference[key])


def _lambada_with_model_endings(ckpt, out_path):
    """The fixture passages, every other one ending in the checkpoint's own greedy next token, so that the
    accuracy is neither 0 nor 1."""
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    engine = InferenceEngine(load_gpt_for_inference(ckpt).model, tokenizer=tok)
    with open(LAMBADA, encoding="utf-8") as f, open(out_path, "w", encoding="utf-8") as g:
        for i, line in enumerate(f):
            text = json.loads(line)["text"]
            if i % 2 == 0:
                ids = tok.tokenize(text)[:-1]
                logits = engine.forward_logits(torch.tensor([ids[-32:]]))[0, -1]  # [V]: the window's context
                text = tok.detokenize(ids + [int(logits[:tok.vocab_size].argmax())])
            g.write(json.dumps({"text": text}) + "\n")


def test_in_loop_scores_equal_tasks_main_and_training_is_unchanged(tmp_path, capsys):
    plain_ckpt, ckpt = str(tmp_path / "plain"), str(tmp_path / "with_tasks")
    plain = pretrain_gpt.main(_args(save=plain_ckpt, save_interval=4))
    lambada = str(tmp_path / "lambada.jsonl")
    _lambada_with_model_endings(plain_ckpt, lambada)
    capsys.readouterr()
    tb = tmp_path / "tb"
    with_tasks = pretrain_gpt.main(_args(save=ckpt, save_interval=2, tensorboard_dir=str(tb)) + _tasks(lambada))
    out = capsys.readouterr().out

    assert [h["lm loss"] for h in with_tasks["history"]] == [h["lm loss"] for h in plain["history"]]
    assert [h["grad_norm"] for h in with_tasks["history"]] == [h["grad_norm"] for h in plain["history"]]
    assert plain["valid"] is None  # no validation loss and no tasks: nothing evaluated

    logged = {int(m.group(1)): [float(v) for v in m.groups()[1:]] for m in VALID.finditer(out)}
    assert sorted(logged) == [2, 4], out[-2000:]
    for iteration in (2, 4):
        want = _reference(ckpt, iteration, lambada)
        # the log line's 7 significant digits
        assert logged[iteration][0] == float(f"{want['lambada acc']:.6E}")
        assert logged[iteration][1:] == pytest.approx([want["wikitext ppl"], want["wikitext adjusted ppl"]],
                                                      rel=2e-6)
    _assert_equal_scores(with_tasks["valid"], want, "TP=1, end of training")
    assert 0.0 < with_tasks["valid"]["lambada acc"] < 1.0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    for key in ("lambada acc", "wikitext ppl", "wikitext adjusted ppl"):
        scalars = {e.step: e.value for e in events.Scalars(key)}
        assert sorted(scalars) == [2, 4]
        assert scalars[4] == pytest.approx(with_tasks["valid"][key], rel=1e-6)  # TensorBoard stores float32


LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "256", "--sequence-parallel"],
           "dp2": [],
           "pp2": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                   "--virtual-pipeline-model-parallel-size", "2"]}  # interleaved: two chunks per stage


def _lambada_for(name, root):
    """DP=2 scores 9 passages (5 on one replica, 4 on the other)."""
    return os.path.join(root, "lambada9.jsonl") if name == "dp2" else LAMBADA


def _layouts_body(rank, world_size, root):
    results = {}
    for name, layout in LAYOUTS.items():
        ckpt = os.path.join(root, name)
        summary = pretrain_gpt.main(_args(save=ckpt, save_interval=2, train_iters=2) + layout
                                    + _tasks(_lambada_for(name, root)))
        results[name] = {"valid": summary["valid"], "history": [h["lm loss"] for h in summary.get("history", [])]}
    # dropout on: the per-rank tracker's state must survive the evaluation too
    plain = pretrain_gpt.main(_args(train_iters=2) + LAYOUTS["tp2"])
    results["tp2 without tasks"] = {"history": [h["lm loss"] for h in plain["history"]]}
    if rank == world_size - 1:  # the last pipeline stage holds the losses
        with open(os.path.join(root, "results.json"), "w") as f:
            json.dump(results, f)


def test_tp2_dp2_pp2_in_loop_scores_equal_tasks_main(tmp_path):
    with open(LAMBADA, encoding="utf-8") as f:
        (tmp_path / "lambada9.jsonl").write_text("".join(f.readlines()[:9]))
    run_distributed(_layouts_body, world_size=2, args=(str(tmp_path),))
    results = json.load(open(tmp_path / "results.json"))
    assert len(results["tp2"]["history"]) == 2
    assert results["tp2"]["history"] == results["tp2 without tasks"]["history"]
    for name in LAYOUTS:
        want = _reference(str(tmp_path / name), 2, _lambada_for(name, str(tmp_path)))
        _assert_equal_scores(results[name]["valid"], want, name)


def test_max_examples_bounds_each_task():
    from megatron.core.parallel_state import ParallelState
    from megatron.training.config import DownstreamEvalConfig
    from megatron.training.downstream_eval import DownstreamEvaluator
    from tests.unit.inference.tiny import tiny_args, tiny_model

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    cfg = DownstreamEvalConfig(eval_tasks=("lambada", "wikitext"), eval_lambada_data=LAMBADA,
                               eval_wikitext_data=WIKI, eval_strict_lambada=True, eval_overlapping_eval=None,
                               eval_tasks_max_examples=3)
    evaluator = DownstreamEvaluator(cfg, tok, 32, 2, ParallelState.single())
    assert [len(t.samples) for t in evaluator.tasks] == [3, 3]
    model = tiny_model(tiny_args(padded_vocab_size=50304, seq_length=32, max_position_embeddings=32))
    model.train()
    scores = evaluator.evaluate([model])
    assert model.training and sorted(scores) == ["lambada acc", "wikitext adjusted ppl", "wikitext ppl"]
    assert (scores["lambada acc"] * 3) in (0.0, 1.0, 2.0, 3.0) and scores["wikitext ppl"] > 1.0


@pytest.mark.parametrize("extra, needle", [
    (["--eval-tasks", "lambada,squad"], "unknown task 'squad'"),
    (["--eval-tasks", "lambada"], "--eval-tasks lambada needs --eval-lambada-data FILE"),
    (["--eval-tasks", "wikitext", "--eval-wikitext-data", "/nonexistent.raw"], "--eval-wikitext-data "
                                                                               "/nonexistent.raw: no such file"),
    (["--eval-lambada-data", LAMBADA], "--eval-lambada-data is given but --eval-tasks does not include lambada"),
    (["--eval-tasks", "wikitext", "--eval-wikitext-data", WIKI, "--eval-tasks-max-examples", "0"],
     "--eval-tasks-max-examples must be >= 1"),
    (["--eval-tasks", "wikitext", "--eval-wikitext-data", WIKI, "--eval-strict-lambada"],
     "--eval-strict-lambada needs --eval-tasks lambada"),
])
def test_bad_flags_are_one_line(extra, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_namespace(_args() + extra)


def test_bad_task_file_names_the_flag(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine passage"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=re.escape(f"--eval-lambada-data {bad} line 2: expected a JSON object")):
        pretrain_gpt.main(_args(train_iters=1, lr_warmup_iters=0)
                          + ["--eval-tasks", "lambada", "--eval-lambada-data", str(bad)])
