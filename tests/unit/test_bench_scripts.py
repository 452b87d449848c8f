"""The benchmark scripts in bench/: they start, the peers read the tokens our trainer reads, the peer trains on CPU.

Timings are not asserted here (they live in bench/results/); these tests keep the scripts runnable on a machine
without a GPU and keep the throughput table's trainers on identical data.
"""

import json
import math
import os
import shlex
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")

MAINTAINED = ["gpu_throughput.py", "minimal_gpt.py", "multi_gpu.py", "memory.py", "optimizer_memory.py",
              "optimizer_step.py", "attention_backends.py", "preprocess_throughput.py", "kernel_sweep.py",
              "ab_trees.py", "zero_shot.py", "host_overhead.py", "sp_memory_paper.py", "sp_backward_gather.py",
              "llama_throughput.py", "llama_peers.py", "finetune_mnli.py", "finetune_tasks.py",
              "finetune_throughput.py"]
# a Python with megatron-core (never imported by the project itself): the Megatron-Core row of the Llama table
MCORE_PYTHON = os.environ.get("MCORE_PYTHON", "/work/venv-mcore/bin/python")


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def corpus_prefix(tmp_path_factory):
    sys.path.insert(0, BENCH)
    try:
        from corpus import prepare_dataset
    finally:
        sys.path.remove(BENCH)
    return prepare_dataset(str(tmp_path_factory.mktemp("bench_corpus")))


# Runs each script given on the command line as ``python SCRIPT --help`` would (as __main__, its folder first on
# sys.path), one after another in this one process: torch is imported once. Prints {script: output} of failures.
HELP_EACH = r"""
import contextlib, io, json, os, runpy, sys, traceback
failed = {}
for path in sys.argv[1:]:
    out, code = io.StringIO(), None
    sys.argv = [path, "--help"]
    sys.path.insert(0, os.path.dirname(path))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        out.write(traceback.format_exc())
        code = "exception"
    finally:
        sys.path.pop(0)
    if code not in (0, None) or "usage:" not in out.getvalue():
        failed[os.path.basename(path)] = out.getvalue()[-2000:]
print(json.dumps(failed))
"""


def test_maintained_scripts_start():
    """``--help`` imports each script and everything it imports at start-up, and builds its argument parser."""
    proc = subprocess.run([sys.executable, "-c", HELP_EACH] + [os.path.join(BENCH, s) for s in MAINTAINED], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, failed


def test_gpu_driver_script_parses():
    proc = subprocess.run(["bash", "-n", os.path.join(BENCH, "gpu_session.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# Runs pretrain_gpt.py's own pretrain() in a child process with a forward step that records every micro-batch
# the trainer's data iterator hands out, then calls the entry point's real forward step with it.
RECORD_TRAINER_BATCHES = """
import sys
import torch
import pretrain_gpt
from megatron.training.training import pretrain

out, argv, seen = sys.argv[1], sys.argv[2:], []

class Recording:
    def __init__(self, it):
        self.it = it

    def __next__(self):
        batch = next(self.it)
        seen.append(batch["text"].clone())
        return batch

def forward_step(ctx, data_iterator, model):
    return pretrain_gpt.forward_step(ctx, Recording(data_iterator), model)

pretrain(pretrain_gpt.model_provider, forward_step, pretrain_gpt.datasets_provider, argv=argv)
torch.save(seen, out)
"""


def test_peers_read_the_batches_our_trainer_reads(corpus_prefix, tmp_path):
    """The peers' batches (bench/corpus.py) equal the micro-batches pretrain_gpt.py's training loop reads with
    the flags the benchmark gives it, iteration by iteration: same .bin/.idx, split, seed and sample order."""
    sys.path.insert(0, BENCH)
    try:
        import gpu_throughput
        from corpus import batches
    finally:
        sys.path.remove(BENCH)

    iters, shape = 3, gpu_throughput.SHAPES["tiny"]
    cmd = gpu_throughput.ours_command(shape, iters - 1, 1, corpus_prefix, "")
    argv = cmd[cmd.index(os.path.join(ROOT, "pretrain_gpt.py")) + 1:]
    out = str(tmp_path / "trainer_batches.pt")
    proc = subprocess.run([sys.executable, "-c", RECORD_TRAINER_BATCHES, out] + argv, cwd=ROOT, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ours = torch.load(out)
    mb = shape["micro_batch_size"]
    assert len(ours) == iters  # one micro-batch per iteration at this global batch
    peers = batches(argv, num_workers=0)
    for a in ours:
        b = next(peers)["text"]
        assert a.shape == (mb, shape["seq_length"] + 1)
        assert torch.equal(a, b)
    # real text: many distinct tokens, and not the same sample over and over
    assert len(torch.unique(torch.cat(ours))) > 100
    assert not torch.equal(ours[0], ours[1])


def test_flops_per_token_is_the_trainer_formula():
    """The MFU of the tables uses the FLOPs our trainer logs: Megatron's 72 L h^2 + 12 L h s + 6 h V per token
    for a 4h MLP, V the padded GPT-2 vocabulary (50,257 rounded up to a multiple of 128)."""
    sys.path.insert(0, BENCH)
    try:
        import gpu_throughput
    finally:
        sys.path.remove(BENCH)
    s = gpu_throughput.SHAPES["124m"]
    L, h, seq, V = s["num_layers"], s["hidden_size"], s["seq_length"], 50304
    assert gpu_throughput.flops_per_token(s) == pytest.approx(72 * L * h * h + 12 * L * h * seq + 6 * h * V)
    assert gpu_throughput.mfu(1e6, s, 100.0) == pytest.approx(1e6 * gpu_throughput.flops_per_token(s) / 100e12)


def test_minimal_gpt_trains_on_the_corpus_on_cpu(corpus_prefix):
    cmd = (f"{shlex.quote(sys.executable)} bench/minimal_gpt.py --device cpu --layers 2 --hidden 64 --heads 4 "
           f"--seq 64 --batch 2 --iters 2 --warmup 1 --data-prefix {shlex.quote(corpus_prefix)}")
    proc = subprocess.run(shlex.split(cmd), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res["losses"]) == 3 and res["ms_per_iter"] > 0
    # an untrained GPT over a 50,304-row vocabulary starts near ln(50304) = 10.83
    assert all(math.isfinite(x) and abs(x - math.log(50304)) < 1.0 for x in res["losses"])


def test_kernel_sweep_picks_the_lowest_summed_slowdown():
    """The sweep prints, per configuration table, the candidate whose time over the best time, summed over the
    swept tensors, is lowest: here B (1.0 + 1.1) beats A (1.0 + 1.5) and C (2.0 + 1.0)."""
    sys.path.insert(0, BENCH)
    try:
        import kernel_sweep
    finally:
        sys.path.remove(BENCH)
    rows = [
        {"key": "COLSUM_CONFIG", "best_ms": 1.0,
         "all": [{"config": {"b": "A"}, "ms": 1.0}, {"config": {"b": "B"}, "ms": 1.0}, {"config": {"b": "C"}, "ms": 2.0}]},
        {"key": "COLSUM_CONFIG", "best_ms": 2.0,
         "all": [{"config": {"b": "A"}, "ms": 3.0}, {"config": {"b": "B"}, "ms": 2.2}, {"config": {"b": "C"}, "ms": 2.0}]},
        {"key": "AMAX_CONFIG", "best_ms": 1.0, "all": [{"config": {"b": "Z"}, "ms": 1.0}]},
    ]
    assert kernel_sweep.choose_colsum(rows) == {"b": "B"}
    assert kernel_sweep.choose_fp8(rows) == {"AMAX_CONFIG": {"b": "Z"}}
    assert kernel_sweep.config_line("COLSUM_CONFIG", {"block_m": 16, "num_warps": 8}) == \
        'COLSUM_CONFIG = {"block_m": 16, "num_warps": 8}'


def test_kernel_sweep_layer_norm_choice_and_min_width():
    """LayerNorm: the forward and backward configurations are chosen separately; ``min_width`` is the narrowest
    width where ours beat PyTorch, raised above any wider width where it lost."""
    sys.path.insert(0, BENCH)
    try:
        import kernel_sweep
    finally:
        sys.path.remove(BENCH)

    def rows(shape, fwd, both, eager):  # fwd / both: {config: ms}
        return [{"shape": shape, "op": "layer_norm fwd [t,h]", "default_ms": fwd[(1, 1)], "best_ms": min(fwd.values()),
                 "all": [{"config": list(c), "ms": t} for c, t in fwd.items()], "eager_ms": None},
                {"shape": shape, "op": "layer_norm fwd+bwd [t,h]", "default_ms": both[(1, 1, 1)],
                 "best_ms": min(both.values()), "all": [{"config": list(c), "ms": t} for c, t in both.items()],
                 "eager_ms": eager}]

    sweep = (rows("1.3b", {(1, 1): 0.05, (2, 2): 0.04}, {(1, 1, 1): 0.15, (2, 2, 2): 0.12}, 0.20)
             + rows("124m", {(1, 1): 0.02, (2, 2): 0.015}, {(1, 1, 1): 0.09, (2, 2, 2): 0.07}, 0.06))
    choice = kernel_sweep.choose_layer_norm(sweep)
    assert tuple(choice["fwd"]) == (2, 2) and tuple(choice["bwd"]) == (2, 2, 2)
    # 124m (h 768): ours 0.07 - 0.02 + 0.015 = 0.065 against PyTorch's 0.06, a loss; 1.3b (h 2048) a win
    assert choice["min_width"] == 2048
    assert kernel_sweep.layer_norm_line(choice) == 'LN_CONFIG = {"min_width": 2048, "fwd": (2, 2), "bwd": (2, 2, 2)}'


def test_host_overhead_proxy_runs_the_trainer_and_counts_ops(tmp_path):
    """The CPU proxy of eager host cost: two real trainer runs give a slope, and one layer issues ATen ops."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "host_overhead.py"), "--models", "gpt", "--layers",
                           "1", "2", "--iters", "5", "--warmup", "2", "--results-dir", str(tmp_path)],
                          cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    with open(tmp_path / "host_overhead.json") as f:
        (row,) = json.load(f)["rows"]
    assert row["model"] == "gpt" and len(row["ms_per_iteration"]) == 2
    assert all(ms > 0 for ms in row["ms_per_iteration"])
    # one layer's forward + backward: at least its four GEMMs and their gradient GEMMs
    assert row["aten_ops_per_layer"] >= 12
    assert "host ms per layer" in (tmp_path / "host_overhead.md").read_text()


def _has_package(python: str, package: str) -> bool:
    return os.access(python, os.X_OK) and subprocess.run(
        [python, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"],
        cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True).returncode == 0


def test_llama_table_rows_on_cpu(corpus_prefix, tmp_path):
    """The Llama table at the tiny shape: ours (pretrain_gpt.py with the Llama flag block), Hugging Face and
    Megatron-Core (in its own Python) train on the same saved micro-batches over a 128,256-row vocabulary; their
    rows merge into the table next to a row already there, with the spec-based FLOPs per token."""
    import warnings

    trainers, pythons = ["ours-llama"], []
    if _has_package(sys.executable, "transformers"):
        trainers.append("hf-llama-compiled")
    else:
        warnings.warn("hf-llama-compiled row not checked: transformers is not installed")
    if _has_package(MCORE_PYTHON, "megatron.core"):
        trainers.append("megatron-core")
        pythons = ["--python", f"megatron-core={MCORE_PYTHON}"]
    else:
        warnings.warn(f"megatron-core row not checked: {MCORE_PYTHON} (MCORE_PYTHON) has no megatron.core")
    old_row = {"trainer": "ours", "num_layers": 12, "hidden_size": 768, "seq_length": 1024, "micro_batch_size": 16,
               "ms_per_iter": 1.0, "tokens_per_s": 1.0, "mfu": 0.5, "mfu_fp8_peak": None, "peak_mem_gib": 1.0,
               "command": "python pretrain_gpt.py"}
    (tmp_path / "gpu_throughput.json").write_text(json.dumps({
        "date": "d", "command": "c", "env": {"gpu": "g", "torch": "t", "cuda": None, "triton": "x",
                                             "transformers": "y", "python": "p"},
        "peak_tflops": {"bf16": 989.0, "fp8": 1979.0}, "rows": [old_row], "extras": {}}))
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "llama_throughput.py"), "--shapes", "tiny",
                           "--device", "cpu", "--trainers", ",".join(trainers), "--iters", "1", "--warmup", "1",
                           "--data-prefix", corpus_prefix, "--results-dir", str(tmp_path)] + pythons,
                          cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    table = json.loads((tmp_path / "gpu_throughput.json").read_text())
    assert table["rows"][0] == old_row
    rows = {r["trainer"]: r for r in table["rows"][1:]}
    assert sorted(rows) == sorted(trainers)
    llama = table["extras"]["llama"]
    # 2 layers of h 64, 4 heads of 16 in 2 groups, SwiGLU 256, untied output of 128,256 rows, seq 128; x 3
    h, d, s, f, V = 64, 16, 128, 256, 128256
    layer = 2 * h * (4 + 2 * 2) * d + 4 * s * 4 * d + 2 * 4 * d * h + 2 * h * f * 2 + 2 * f * h
    assert llama["flops_per_token"]["2x64"] == pytest.approx(3 * (2 * layer + 2 * h * V))
    for trainer, row in rows.items():
        assert row["ms_per_iter"] > 0 and row["mfu_fp8_peak"] is None
        losses = llama["losses"][f"{trainer}/2x64"]
        # an untrained model over 128,256 rows starts near ln(128256) = 11.76, on every trainer
        assert len(losses) == 2 and all(abs(x - math.log(V)) < 1.0 for x in losses), (trainer, losses)


def test_gpu_session_steps_name_existing_cases():
    """The GPU steps name what the scripts accept: every ``--case`` of an A/B step parses in ab_trees.py, every
    ``--only`` configuration of the memory step is one of plan_validation.py's, every peer of the Llama step is
    one of llama_throughput.py's trainers."""
    import re

    sys.path.insert(0, BENCH)
    try:
        import ab_trees
        import llama_throughput
        import plan_validation
    finally:
        sys.path.remove(BENCH)
    with open(os.path.join(BENCH, "gpu_session.sh")) as f:
        text = f.read().replace("\\\n", " ")
    cases = re.findall(r'--case "([^"]*)"', text)
    assert len(cases) >= 9
    parsed = {ab_trees.parse_case(c)[:2] for c in cases}
    assert {("124m", "ours"), ("124m", "ours-fp8"), ("1.3b", "ours"), ("1.3b", "ours-fp8"),
            ("large", "ours-bert")} <= parsed
    (only,) = re.findall(r"plan_validation\.py [^|]*?--only\s+(\S+)", text)
    names = {c[0] for c in plan_validation.CONFIGS}
    assert set(only.split(",")) <= names and sum("dropout" in n for n in only.split(",")) == 4
    step = text[text.index("  llama-1b|llama-3b)"):text.index(";;", text.index("  llama-1b|llama-3b)"))]
    assert "bench/llama_throughput.py" in step and "--python" in step
    assert llama_throughput.python_for([f"torchtitan,torchtitan-fp8={sys.executable}"]) == {
        "torchtitan": sys.executable, "torchtitan-fp8": sys.executable}


def test_finetune_benches_run_on_cpu(tmp_path):
    """bench/finetune_mnli.py (two seeds, each one run of tasks/main.py and one of Hugging Face) and
    bench/finetune_tasks.py --task RACE on a tiny random Hugging Face BERT folder and generated data: every run
    counts the whole dev set, and the result files hold what the runs printed."""
    import numpy as np
    import transformers

    words = [f"w{i}" for i in range(100)]
    model = tmp_path / "bert"
    model.mkdir()
    (model / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    (model / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=105, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=512)
    transformers.BertModel(cfg).save_pretrained(str(model))
    rng = np.random.RandomState(0)
    mnli = tmp_path / "mnli"
    mnli.mkdir()
    for name, n in (("train.tsv", 64), ("dev_matched.tsv", 12)):
        rows = ["\t".join(["index"] + [""] * 7 + ["sentence1", "sentence2", "label1", "gold_label"])]
        for i in range(n):
            label = ("contradiction", "entailment", "neutral")[rng.randint(3)]
            rows.append("\t".join([str(i)] + [""] * 7 + [" ".join(rng.choice(words, 6)), " ".join(rng.choice(words, 5)),
                                                        label, label]))
        (mnli / name).write_text("\n".join(rows) + "\n")
    race = tmp_path / "race" / "RACE"
    for split, level, files in (("train", "middle", 4), ("dev", "high", 1), ("dev", "middle", 1)):
        (race / split / level).mkdir(parents=True)
        for i in range(files):
            (race / split / level / f"{i}.txt").write_text(json.dumps({
                "article": " ".join(rng.choice(words, 30)), "questions": [" ".join(rng.choice(words, 4))] * 4,
                "options": [[" ".join(rng.choice(words, 2)) for _ in range(4)] for _ in range(4)],
                "answers": list("ABCD")}))
    out = tmp_path / "mnli_result"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "finetune_mnli.py"), "--wheel", str(model), "--data",
                           str(mnli), "--seeds", "1,2", "--out", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "mnli_result.json").read_text())
    assert [r["seed"] for r in result["runs"]] == [1, 2] and result["train_examples"] == 64
    for r in result["runs"]:
        assert r["ours"]["total"] == r["hf"]["total"] == 12
        assert len(r["ours"]["losses"]) == len(r["hf"]["losses"]) == 2  # 64 pairs, batch 32
        assert r["difference_points"] == pytest.approx(r["ours"]["accuracy"] - r["hf"]["accuracy"], abs=1e-3)
    assert f"| 2 | tasks/main.py | {result['runs'][1]['ours']['losses'][0]:.6f} |" in \
        (tmp_path / "mnli_result.md").read_text()
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "finetune_tasks.py"), "--task", "RACE", "--wheel",
                           str(model), "--data", str(tmp_path), "--train-passages", "0", "--dev-passages", "0",
                           "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--out",
                           str(tmp_path / "race_result")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    race_result = json.loads((tmp_path / "race_result.json").read_text())
    assert race_result["train_examples"] == 16 and race_result["iterations"] == 4
    assert [(f["file"], f["total"]) for f in race_result["files"]] == [("dev_high", 4), ("dev_middle", 4)]
    assert race_result["overall"]["total"] == 8


def test_finetune_throughput_runs_on_cpu(tmp_path):
    """bench/finetune_throughput.py at its tiny shape: both trainers timed over the asked iterations."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "finetune_throughput.py"), "--shape", "tiny",
                           "--device", "cpu", "--iters", "3", "--warmup", "1", "--results-dir", str(tmp_path)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "finetune_throughput.json").read_text())
    assert [len(r["ms_per_iteration"]) for r in result["rows"]] == [3, 3]
    assert all(r["tokens_per_s"] > 0 and r["seq"] == 32 for r in result["rows"])
    assert result["ratio"] == pytest.approx(result["rows"][1]["median_ms"] / result["rows"][0]["median_ms"])
