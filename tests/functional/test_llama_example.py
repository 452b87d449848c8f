"""examples/pretrain_llama.sh itself, shrunk by flags given after it, trains on CPU (torchrun, one process,
bf16, distributed optimizer as the script sets them) on the bundled corpus with a Hugging Face tokenizer.json made
offline from the bundled GPT-2 BPE files, and its loss falls."""

import os
import subprocess
import sys

from megatron.core.tokenizer import build_tokenizer
from tests.functional.harness import ROOT, parse_iterations

LAYERS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 2, 64, 4, 2, 16, 128, 50304


def test_the_llama_example_trains_tiny_on_cpu(data_prefix, tmp_path):
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(ROOT, "data/gpt2-vocab.json"),
                           merge_file=os.path.join(ROOT, "data/gpt2-merges.txt"))
    gpt2._tok.save(str(tmp_path / "tokenizer.json"))  # the same token ids as the GPT-2 BPE that made data_prefix
    bindir = os.path.dirname(sys.executable)  # the script calls python and torchrun
    env = dict(os.environ, GPUS="1", DATA=data_prefix, TOKENIZER=str(tmp_path / "tokenizer.json"),
               CKPT=str(tmp_path / "ckpt"), PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    env.pop("DRY_RUN", None)
    sizes = ["--num-layers", LAYERS, "--hidden-size", HIDDEN, "--num-attention-heads", HEADS, "--num-query-groups",
             GROUPS, "--kv-channels", HEAD_DIM, "--ffn-hidden-size", FFN, "--seq-length", 64,
             "--micro-batch-size", 4, "--global-batch-size", 8, "--train-iters", 12, "--lr", 3e-3,
             "--lr-warmup-iters", 2, "--log-interval", 3, "--eval-iters", 0]
    proc = subprocess.run(["bash", "examples/pretrain_llama.sh"] + [str(a) for a in sizes], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    # the script's Llama flags made the model: untied embedding and output layer, no position table (RoPE), grouped
    # query/key/value projection, SwiGLU's two input projections, RMSNorm weights only, no biases
    per_layer = (HIDDEN * (HEADS + 2 * GROUPS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + HIDDEN * 2 * FFN
                 + FFN * HIDDEN + 2 * HIDDEN)
    params = 2 * VOCAB * HIDDEN + LAYERS * per_layer + HIDDEN
    assert f"parameters on (tensor, pipeline) rank (0, 0): {params:,}" in proc.stdout
    its = parse_iterations(proc.stdout)
    assert sorted(its) == [3, 6, 9, 12]
    assert its[3]["lm loss"] > 10.0 and its[12]["lm loss"] < its[3]["lm loss"] - 1.0, its  # each: the mean of 3 iterations
