"""pretrain_gpt.py / pretrain_bert.py --dry-run: the flags are validated as a run on N GPUs and the planner's prediction is printed,
exit status 0, before any process group, dataset, checkpoint or TensorBoard file exists."""

import os

from megatron.training.dry_run import dry_run
from tests.functional.harness import ROOT, run_pretrain

VOCAB = os.path.join(ROOT, "data/gpt2-vocab.json")
MERGES = os.path.join(ROOT, "data/gpt2-merges.txt")
GPT_1B3 = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
           "--max-position-embeddings", "2048", "--micro-batch-size", "2", "--global-batch-size", "512",
           "--train-iters", "1000", "--lr", "1e-4", "--vocab-file", VOCAB, "--merge-file", MERGES, "--bf16"]
# the same run in the planner's own flags, written out by hand: validation's values made explicit
PLANNER_1B3 = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
               "--micro-batch-size", "2", "--global-batch-size", "512", "--bf16", "--vocab-size", "50257"]


def test_dry_run_prints_the_prediction_for_the_given_gpus(tmp_path):
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    proc = run_pretrain(GPT_1B3 + ["--data-path", str(tmp_path / "no_such_prefix"), "--save", str(ckpt),
                                   "--save-interval", "1", "--tensorboard-dir", str(tb),
                                   "--tensor-model-parallel-size", "2", "--recompute-activations",
                                   "--use-distributed-optimizer", "--dry-run", "16"], timeout=300)
    want, fits = dry_run(PLANNER_1B3 + ["--tensor-model-parallel-size", "2", "--recompute-granularity", "selective",
                                        "--use-distributed-optimizer"], num_gpus=16)
    assert fits
    assert proc.stdout.strip() == want.strip()
    assert "on 16 x h200" in proc.stdout and "TP2 PP1 DP8" in proc.stdout
    assert proc.stderr.strip() == ""  # the missing --data-path was not read
    assert not ckpt.exists() and not tb.exists()  # nothing of a run was started


def test_dry_run_takes_the_launchers_world_size_and_rewrites_older_flags():
    # WORLD_SIZE without MASTER_ADDR: joining a process group would fail, so none is joined
    proc = run_pretrain(GPT_1B3 + ["--mock-data", "--checkpoint-activations", "--pipeline-model-parallel-size", "2",
                                   "--dry-run"], env={"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}, timeout=300)
    want, _ = dry_run(PLANNER_1B3 + ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                                     "--recompute-method", "uniform", "--recompute-num-layers", "1"], num_gpus=4)
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("note: --checkpoint-activations")
    assert "\n".join(lines[1:]) == want.strip()
    assert "on 4 x h200" in lines[1] and "PP2 DP2" in proc.stdout


def test_dry_run_of_a_model_too_large_says_so_and_exits_0():
    big = ["--num-layers", "96", "--hidden-size", "8192", "--num-attention-heads", "64", "--seq-length", "2048",
           "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-4", "--bf16", "--mock-data",
           "--vocab-file", VOCAB, "--merge-file", MERGES]  # about 78B parameters on one GPU
    proc = run_pretrain(big + ["--dry-run", "1"], timeout=300)
    assert "DOES NOT FIT" in proc.stdout


def test_dry_run_checks_the_flags_first():
    proc = run_pretrain(GPT_1B3 + ["--mock-data", "--tensor-model-parallel-size", "2", "--dry-run", "3"],
                        expect_ok=False, timeout=300)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "3" in lines[0], proc.stderr
    assert proc.stdout.strip() == ""


def test_an_entry_point_without_a_dry_run_refuses_it_instead_of_training():
    import pytest

    from megatron.training.flag_table import ConfigError
    from megatron.training.training import pretrain

    def never(*_):
        raise AssertionError("nothing may be built")

    with pytest.raises(ConfigError, match="--dry-run"):
        pretrain(never, never, never, argv=GPT_1B3 + ["--mock-data", "--dry-run", "1"])


def test_bert_dry_run_predicts_the_bert_model(tmp_path):
    from megatron.core.tokenizer import build_tokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(995)]) + "\n")
    size = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(vocab)).vocab_size
    bert_large = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "512",
                  "--max-position-embeddings", "512", "--micro-batch-size", "4", "--global-batch-size", "32",
                  "--train-iters", "100", "--lr", "1e-4", "--bf16", "--tokenizer-type", "BertWordPieceLowerCase",
                  "--vocab-file", str(vocab), "--mask-prob", "0.15"]
    proc = run_pretrain(bert_large + ["--data-path", str(tmp_path / "no_such_prefix"), "--dry-run", "8"],
                        script="pretrain_bert.py", timeout=300)
    want, fits = dry_run(["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
                          "--seq-length", "512", "--micro-batch-size", "4", "--global-batch-size", "32", "--bf16",
                          "--vocab-size", str(size)], num_gpus=8, model="bert")
    assert fits and "on 8 x h200" in proc.stdout
    assert proc.stdout.strip() == want.strip()
    assert proc.stderr.strip() == ""
