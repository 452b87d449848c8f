"""A 50-iteration GPU training run with the fused kernels matches the unfused path, and FP8 tracks bf16 (GPU only).

Two runs of pretrain_gpt.py on the bundled corpus (tokenised here with tools/preprocess_data.py), same seed,
dropout 0, bf16: one with the fused kernels and the fused cross-entropy, one with
``--no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm`` (PyTorch references, vocab-parallel
cross-entropy). The per-iteration losses must agree to bf16 accuracy and training must make progress.
"""

import gzip
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS = re.compile(r"iteration\s+(\d+)/.*?lm loss:\s*([0-9.Ee+-]+)")


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused_training")
    jsonl = tmp / "corpus.jsonl"
    with gzip.open(os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "rb") as fin, open(jsonl, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(jsonl),
                    "--output-prefix", str(tmp / "corpus"), "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", os.path.join(ROOT, "data", "gpt2-vocab.json"),
                    "--merge-file", os.path.join(ROOT, "data", "gpt2-merges.txt"), "--append-eod"],
                   check=True, cwd=ROOT)
    return str(tmp / "corpus_text_document")


def _train(data_prefix: str, extra: list) -> list:
    args = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
            "--max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 8 --train-iters 50 "
            "--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 "
            "--bf16 --attention-dropout 0 --hidden-dropout 0 --seed 1234 --split 100,0,0 --eval-iters 0 "
            "--tokenizer-type GPT2BPETokenizer --make-vocab-size-divisible-by 128 --log-interval 1 "
            f"--vocab-file {ROOT}/data/gpt2-vocab.json --merge-file {ROOT}/data/gpt2-merges.txt").split()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args, "--data-path",
                           data_prefix, *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    losses = [float(m.group(2)) for m in LOSS.finditer(proc.stdout)]
    assert len(losses) == 50, proc.stdout[-4000:]
    return losses


@pytest.fixture(scope="module")
def fused_bf16(data_prefix):
    return _train(data_prefix, ["--cross-entropy-loss-fusion"])


def test_fused_and_unfused_losses_match(data_prefix, fused_bf16):
    fused = fused_bf16
    unfused = _train(data_prefix, ["--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm"])
    assert abs(fused[0] - unfused[0]) < 1e-3 * unfused[0]  # same init, same data, same first loss
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert abs(a - b) < 2e-2 * b, f"iteration {i + 1}: fused {a} vs unfused {b}"
    assert sum(fused[-5:]) / 5 < fused[0] - 2.0  # and it learns


@pytest.mark.parametrize("extra", [[], ["--recompute-granularity", "selective", "--recompute-modules", "mlp_act"],
                                   ["--enable-cuda-graph"],
                                   ["--fp8-recipe", "delayed", "--recompute-granularity", "selective",
                                    "--recompute-modules", "mlp_act"],
                                   ["--fp8-recipe", "delayed", "--enable-cuda-graph"]],
                         ids=["eager", "gelu-recompute", "cuda-graph", "delayed-gelu-recompute", "delayed-cuda-graph"])
def test_fp8_hybrid_tracks_bf16(data_prefix, fused_bf16, extra):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    bf16 = fused_bf16
    fp8 = _train(data_prefix, ["--cross-entropy-loss-fusion", "--fp8-format", "hybrid", *extra])
    for i, (a, b) in enumerate(zip(fp8, bf16)):
        assert abs(a - b) < 3e-2 * b, f"iteration {i + 1}: fp8 {a} vs bf16 {b}"
    assert sum(fp8[-5:]) / 5 < fp8[0] - 2.0
