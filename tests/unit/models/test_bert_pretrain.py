"""pretrain_bert.py through the real training loop on a small in-memory masked-LM dataset.

The dataset is generated here: each sample is ``[CLS] A [SEP] B [SEP]`` padded to the sequence length, segment A
(two thirds of the tokens) drawn from one half of a tiny WordPiece vocabulary and B (one third) from the other,
swapped (``is_random`` 1) half of the time, with 15% of the tokens masked. The MLM loss (the segments' unigram
statistics) and the sentence-order loss (segment lengths and ranges) are both learnable, so training must lower
them; and the loss and grad norm of every iteration must be the same with one process, TP2 with sequence
parallelism, PP2 (plain and interleaved) and DP2 with the distributed optimizer.
"""

import json
import os
import re
import sys

import numpy as np
import pytest

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pretrain_bert  # noqa: E402

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = 59  # 5 special + 59 words = 64 entries, + [BOS] [EOS] appended by the tokenizer
SEQ = 16


def _zipf(n: int) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1)
    return p / p.sum()


class MaskedPairs:
    """Deterministic masked-LM samples with Megatron's field names (sample ``i`` depends on ``seed`` and ``i``)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.RandomState((self.seed * 7919 + int(i)) % 2**31)
        pad, cls, sep, mask = 0, 2, 3, 4
        length = rng.randint(9, SEQ + 1)
        n_b = (length - 3) // 3  # the second segment is the shorter one, so the order shows in the segment lengths
        n_a = length - 3 - n_b
        half = WORDS // 2
        a = 5 + rng.choice(half, n_a, p=_zipf(half))
        b = 5 + half + rng.choice(WORDS - half, n_b, p=_zipf(WORDS - half))
        is_random = int(rng.rand() < 0.5)
        if is_random:
            a, b = b, a
        text = np.full(SEQ, pad, dtype=np.int64)
        text[:length] = np.concatenate([[cls], a, [sep], b, [sep]])
        types = np.zeros(SEQ, dtype=np.int64)
        types[len(a) + 2: length] = 1
        padding_mask = (np.arange(SEQ) < length).astype(np.int64)
        candidates = np.array([p for p in range(length) if text[p] not in (cls, sep)])
        picked = rng.choice(candidates, max(1, int(round(0.15 * len(candidates)))), replace=False)
        labels = np.full(SEQ, -1, dtype=np.int64)
        labels[picked] = text[picked]
        loss_mask = (labels >= 0).astype(np.int64)
        text[picked] = mask
        return {"text": text, "types": types, "labels": labels, "is_random": is_random, "loss_mask": loss_mask,
                "padding_mask": padding_mask, "truncated": 0}


def in_memory_datasets(ctx, num_samples):
    return tuple(MaskedPairs(max(n, 1), ctx.config.training.seed + k) for k, n in enumerate(num_samples))


def _argv(vocab: str, iters: int, **overrides):
    opts = {"num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": SEQ,
            "max-position-embeddings": SEQ, "micro-batch-size": 2, "global-batch-size": 8, "train-iters": iters,
            "lr": 3e-3, "min-lr": 3e-4, "lr-decay-style": "cosine", "lr-warmup-iters": 2, "weight-decay": 0.01,
            "clip-grad": 1.0, "attention-dropout": 0.0, "hidden-dropout": 0.0, "seed": 1234, "log-interval": 1,
            "eval-iters": 0, "tokenizer-type": "BertWordPieceLowerCase", "vocab-file": vocab,
            "data-path": "in-memory", "split": "100,0,0", "num-workers": 0, "attention-backend": "unfused"}
    opts.update(overrides)
    tp = int(opts.get("tensor-model-parallel-size", 1))
    opts["make-vocab-size-divisible-by"] = 128 // tp  # the same padded vocabulary (128) at every TP size
    argv = []
    for key, value in opts.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert_vocab") / "vocab.txt"
    path.write_text("\n".join(SPECIAL + [f"w{i}" for i in range(WORDS)]) + "\n")
    return str(path)


def _history(summary):
    return [{k: v for k, v in row.items() if k != "iteration"} for row in summary["history"]]


def test_tiny_bert_learns_both_objectives(vocab, capsys):
    summary = pretrain_bert.main(_argv(vocab, 60, **{"hidden-size": 64}), datasets=in_memory_datasets)
    out = capsys.readouterr().out
    assert "| lm loss: " in out and "| sop loss: " in out and "| sop accuracy: " in out
    hist = _history(summary)
    assert len(hist) == 60
    first = np.mean([h["lm loss"] for h in hist[:5]])
    last = np.mean([h["lm loss"] for h in hist[-10:]])
    assert last < 0.8 * first, (first, last)
    sop_last = np.mean([h["sop loss"] for h in hist[-10:]])
    assert sop_last < 0.3, sop_last  # chance is ln 2 = 0.69
    assert np.mean([h["sop accuracy"] for h in hist[-10:]]) > 0.85  # chance is 0.5


def test_without_binary_head_only_the_lm_loss_is_reported(vocab):
    summary = pretrain_bert.main(_argv(vocab, 3, **{"bert-no-binary-head": True}), datasets=in_memory_datasets)
    assert all(set(h) == {"lm loss", "grad_norm"} for h in _history(summary))


def test_bad_input_is_one_clear_line(vocab, tmp_path):
    from megatron.training.flag_table import ConfigError, SharedError

    with pytest.raises(ConfigError, match="--tokenizer-type must be one of BertWordPieceLowerCase, BertWordPieceCase"):
        pretrain_bert.main(_argv(vocab, 3, **{"tokenizer-type": "GPT2BPETokenizer"}), datasets=in_memory_datasets)
    with pytest.raises(ConfigError, match=r"--mask-prob must be in \(0, 1\), got 1.5"):
        pretrain_bert.main(_argv(vocab, 3, **{"mask-prob": 1.5}), datasets=in_memory_datasets)
    with pytest.raises(ConfigError, match="--seq-length 4 is too short for a BERT sample"):
        pretrain_bert.main(_argv(vocab, 3, **{"seq-length": 4}), datasets=in_memory_datasets)
    bad_vocab = tmp_path / "vocab.txt"
    bad_vocab.write_text("[PAD]\n[UNK]\n[SEP]\nhello\n")
    with pytest.raises(SharedError, match=r"lacks the BERT special token \[CLS\]"):
        pretrain_bert.main(_argv(str(bad_vocab), 3), datasets=in_memory_datasets)


def test_bert_section_is_stored_as_plain_types(vocab, tmp_path):
    import torch

    ckpt = str(tmp_path / "ckpt")
    pretrain_bert.main(_argv(vocab, 2, **{"save": ckpt, "mask-prob": 0.2, "masking-max-ngram": 2}),
                       datasets=in_memory_datasets)
    state = torch.load(os.path.join(ckpt, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"), weights_only=True)
    args = state["args"]
    assert args["mask_prob"] == 0.2 and args["masking_max_ngram"] == 2 and args["bert_binary_head"] is True
    assert args["short_seq_prob"] == 0.1 and args["whole_word_masking"] is True


def test_mock_data_trains(vocab, capsys):
    argv = _argv(vocab, 2, **{"eval-iters": 1, "eval-interval": 1, "split": "98,1,1"})
    argv[argv.index("--data-path"):argv.index("--data-path") + 2] = ["--mock-data"]
    summary = pretrain_bert.main(argv)
    out = capsys.readouterr().out
    assert len(summary["history"]) == 2 and "validation loss at iteration" in out
    assert set(summary["valid"]) == {"lm loss", "sop loss", "sop accuracy"}
    assert "sop accuracy value:" in out and "sop accuracy PPL" not in out


LAYOUTS = {
    "tp2": {"tensor-model-parallel-size": 2},
    "tp2_sp": {"tensor-model-parallel-size": 2, "sequence-parallel": True},
    "pp2": {"pipeline-model-parallel-size": 2},
    # interleaved 1F1B: two model chunks of one layer per stage (stage 0 holds layers 0 and 2)
    "pp2_vp2_4layers": {"pipeline-model-parallel-size": 2, "num-layers": 4,
                        "num-layers-per-virtual-pipeline-stage": 1},
    "dp2_distopt": {"use-distributed-optimizer": True},
}
LAYOUTS_4 = {"tp2_pp2": {"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2},
             # four layers over four stages: the two middle stages read the batch too (for the padding mask)
             "pp4_4layers": {"pipeline-model-parallel-size": 4, "num-layers": 4}}


def _layouts(rank, world, vocab, out_dir):
    for name, extra in (LAYOUTS if world == 2 else LAYOUTS_4).items():
        summary = pretrain_bert.main(_argv(vocab, 6, **extra), datasets=in_memory_datasets)
        if summary.get("history"):  # ranks of the last pipeline stage
            with open(os.path.join(out_dir, f"{name}_rank{rank}.json"), "w") as f:
                json.dump(_history(summary), f)


def test_losses_and_grad_norms_match_across_layouts(vocab, tmp_path):
    reference = _history(pretrain_bert.main(_argv(vocab, 6), datasets=in_memory_datasets))
    reference_4 = _history(pretrain_bert.main(_argv(vocab, 6, **{"num-layers": 4}), datasets=in_memory_datasets))
    run_distributed(_layouts, 2, (vocab, str(tmp_path)))
    run_distributed(_layouts, 4, (vocab, str(tmp_path)))
    for name in [*LAYOUTS, *LAYOUTS_4]:
        ref_hist = reference_4 if name.endswith("_4layers") else reference
        files = sorted(p for p in os.listdir(tmp_path) if p.startswith(f"{name}_rank"))
        assert files, name
        for fname in files:
            with open(tmp_path / fname) as f:
                hist = json.load(f)
            assert len(hist) == len(ref_hist) == 6
            for it, (got, ref) in enumerate(zip(hist, ref_hist)):
                for key in ("lm loss", "sop loss", "sop accuracy", "grad_norm"):
                    assert got[key] == pytest.approx(ref[key], rel=1e-5), (name, it + 1, key, got[key], ref[key])


def test_resume_is_bit_exact_with_dropout(vocab, tmp_path):
    """Three iterations, save, exit; resume for three more: the same losses as six uninterrupted iterations."""
    drop = {"attention-dropout": 0.1, "hidden-dropout": 0.1}
    whole = _history(pretrain_bert.main(_argv(vocab, 6, **drop), datasets=in_memory_datasets))
    ckpt = str(tmp_path / "ckpt")
    first = pretrain_bert.main(_argv(vocab, 6, **drop, **{"exit-interval": 3, "save": ckpt}),
                               datasets=in_memory_datasets)
    assert first["iteration"] == 3
    second = pretrain_bert.main(_argv(vocab, 6, **drop, **{"load": ckpt, "save": ckpt}), datasets=in_memory_datasets)
    resumed = _history(second)
    assert [row["iteration"] for row in second["history"]] == [4, 5, 6]
    assert _history(first) == whole[:3]
    assert resumed == whole[3:]


def _loss_scales(out: str):
    return [float(x) for x in re.findall(r"\| loss scale: ([0-9.]+) \|", out)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_trains(precision, vocab, capsys):
    """bf16 and fp16 through pretrain_bert.py: finite losses that fall, and the loss scale of every iteration in
    the log line (1.0 without fp16). fp16 starts its dynamic scale at 2^12 and doubles it after every window of 4
    clean steps; a step whose scaled gradients overflow is skipped (no grad norm), and with Megatron's default
    hysteresis of 2 the scale halves at the second overflow in a row."""
    iters = 30
    flags = {"bf16": True} if precision == "bf16" else {"fp16": True, "initial-loss-scale": 4096,
                                                        "loss-scale-window": 4}
    summary = pretrain_bert.main(_argv(vocab, iters, **flags), datasets=in_memory_datasets)
    scales = _loss_scales(capsys.readouterr().out)
    hist = _history(summary)
    assert len(hist) == len(scales) == iters
    stepped = [h for h in hist if h["grad_norm"] is not None]
    assert np.isfinite([[h["lm loss"], h["sop loss"]] for h in hist]).all()
    assert np.isfinite([h["grad_norm"] for h in stepped]).all()
    assert np.mean([h["lm loss"] for h in hist[-5:]]) < 0.9 * np.mean([h["lm loss"] for h in hist[:5]])
    if precision == "bf16":
        assert scales == [1.0] * iters and len(stepped) == iters
        return
    # doubled after the first window of 4 steps, and grew through at least 4 windows in all
    assert scales[0] == 4096.0 and scales[3] == 8192.0 and max(scales) >= 4096.0 * 2 ** 4, scales
    assert all(b / a in (0.5, 1.0, 2.0) for a, b in zip(scales, scales[1:])), scales
    halved = [it for it in range(1, iters) if scales[it] == scales[it - 1] / 2]
    skipped = [it for it, h in enumerate(hist) if h["grad_norm"] is None]
    assert halved == [it for it in skipped if it - 1 in skipped] and len(skipped) <= 3, (halved, skipped)


@pytest.mark.parametrize("recompute,per_microbatch", [
    # uniform: groups of one layer, both recomputed; block: only the first layer; selective: each attention core
    ({"recompute-granularity": "full", "recompute-method": "uniform", "recompute-num-layers": 1}, 2),
    ({"recompute-granularity": "full", "recompute-method": "block", "recompute-num-layers": 1}, 1),
    ({"recompute-granularity": "selective"}, 2),
], ids=["full-uniform", "full-block", "selective"])
def test_recomputation_gives_the_same_losses(recompute, per_microbatch, vocab, no_recompute_history, monkeypatch):
    """fp32, dropout 0: recomputation reruns the same arithmetic, so every value is bit for bit the same. The
    recompute checkpoint is counted, so a run that silently kept every activation would fail."""
    from megatron.core import tensor_parallel

    calls, checkpoint = [], tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    got = _history(pretrain_bert.main(_argv(vocab, 4, **recompute), datasets=in_memory_datasets))
    assert len(calls) == 4 * 4 * per_microbatch, len(calls)  # 4 iterations of 4 microbatches
    assert got == no_recompute_history


@pytest.fixture(scope="module")
def no_recompute_history(vocab):
    return _history(pretrain_bert.main(_argv(vocab, 4), datasets=in_memory_datasets))


def test_fp8_tracks_bf16(vocab):
    """--fp8-format hybrid (E4M3 forward, E5M2 gradients; on CPU torch._scaled_mm does the same arithmetic as the
    GPU) against the same run in bf16, from the same initial weights and data, at every iteration.

    Tolerance: the loss is an average over every masked position (and the SOP loss over every sample) of a batch,
    so the per-element FP8 rounding (E4M3 keeps 3 mantissa bits) averages out; per iteration, over eight
    iterations of this model, the measured relative gaps to bf16 are at most 2.2e-4 (lm loss), 8.6e-4 (sop loss)
    and 3.1e-3 (grad norm, a sum of squares of the quantized gradients). The bounds, about five times those, leave
    room for another CPU's rounding while a wrong scale or a skipped quantization (gaps of order 1, or none) fails.
    """
    bf16 = _history(pretrain_bert.main(_argv(vocab, 8, bf16=True), datasets=in_memory_datasets))
    fp8 = _history(pretrain_bert.main(_argv(vocab, 8, bf16=True, **{"fp8-format": "hybrid"}),
                                      datasets=in_memory_datasets))
    assert len(fp8) == len(bf16) == 8
    assert fp8 != bf16  # the GEMMs really ran in FP8
    for it, (got, ref) in enumerate(zip(fp8, bf16)):
        for key, rel in (("lm loss", 1e-3), ("sop loss", 5e-3), ("grad_norm", 2e-2)):
            assert got[key] == pytest.approx(ref[key], rel=rel), (it + 1, key, got[key], ref[key])


def _megatron_layout_resume(rank, world, vocab, ckpt, out_dir):
    drop = {"attention-dropout": 0.1, "hidden-dropout": 0.1, "tensor-model-parallel-size": 2}
    whole = pretrain_bert.main(_argv(vocab, 6, **drop), datasets=in_memory_datasets)
    first = pretrain_bert.main(_argv(vocab, 6, **drop, **{"exit-interval": 3, "save": ckpt,
                                                          "ckpt-layout": "megatron"}), datasets=in_memory_datasets)
    second = pretrain_bert.main(_argv(vocab, 6, **drop, **{"load": ckpt}), datasets=in_memory_datasets)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"whole": whole["history"], "first": first["history"], "second": second["history"]}, f)


def test_megatron_layout_resume_is_bit_exact_tp2_with_dropout(vocab, tmp_path):
    """--save --ckpt-layout megatron at TP=2 (gloo), then --load: iterations 4-6 print the losses, sop accuracy and
    grad norms of the uninterrupted run bit for bit (dropout on, so the RNG state came back too), and the files are
    Megatron-LM's (pickled args with the consumed samples, per-rank ``mp_rank_TT`` folders)."""
    from megatron.core.checkpoint_formats import load_megatron_file
    from megatron.core.checkpoint_formats.safe_load import to_plain

    ckpt, out_dir = str(tmp_path / "ckpt"), tmp_path / "out"
    out_dir.mkdir()
    run_distributed(_megatron_layout_resume, 2, (vocab, ckpt, str(out_dir)))
    for rank in (0, 1):
        with open(out_dir / f"rank{rank}.json") as f:
            runs = json.load(f)
        assert [r["iteration"] for r in runs["first"]] == [1, 2, 3]
        assert [r["iteration"] for r in runs["second"]] == [4, 5, 6]
        assert runs["first"] + runs["second"] == runs["whole"]
    folder = os.path.join(ckpt, "iter_0000003")
    assert sorted(os.listdir(folder)) == ["manifest.json", "mp_rank_00", "mp_rank_01"]
    for tp_rank in (0, 1):
        state = load_megatron_file(os.path.join(folder, f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt"))
        args = to_plain(state["args"])
        assert (args["consumed_train_samples"], args["tensor_model_parallel_size"], state["iteration"]) == (24, 2, 3)
        assert "lm_head.dense.weight" in state["model"] and "binary_head.weight" in state["model"]


@pytest.mark.parametrize("script,world", [("pretrain_bert.sh", 8), ("pretrain_bert_distributed.sh", 32)])
def test_example_scripts_parse(script, world, vocab, tmp_path):
    """The example launch scripts, run by bash with a ``torchrun`` that records its arguments, pass a valid
    BERT-large configuration for their GPU count (their shared flags come from examples/bert_large_flags.sh)."""
    import subprocess

    from megatron.training.arguments import parse_config

    recorded = tmp_path / "torchrun_args"
    (tmp_path / "torchrun").write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > {recorded}\n')
    (tmp_path / "torchrun").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", DATA="corpus_text_sentence", VOCAB=vocab,
               CKPT="ckpt", NNODES="4", NODE_RANK="0", MASTER_ADDR="localhost")
    subprocess.run(["bash", os.path.join(ROOT, "examples", script)], env=env, check=True, cwd=tmp_path)
    launcher_args = recorded.read_text().split("\0")[:-1]
    argv = launcher_args[launcher_args.index("pretrain_bert.py") + 1:]
    cfg, _ = parse_config(argv, world_size=world, extra_sections=[pretrain_bert.BERT])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (24, 1024, 16, 512)
    assert cfg.extra["bert"].bert_binary_head and cfg.extra["bert"].mask_prob == 0.15
    # the shared block and each script's own flags both arrive
    own = {"pretrain_bert.sh": (1, 1, 32, 10000), "pretrain_bert_distributed.sh": (2, 2, 1024, 5000)}[script]
    par, ck = cfg.parallel, cfg.checkpointing
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, cfg.training.global_batch_size,
            ck.save_interval) == own
    assert ck.save == ck.load == "ckpt" and cfg.precision.bf16 and cfg.data.vocab_file == vocab
