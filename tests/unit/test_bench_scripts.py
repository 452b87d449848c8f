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
              "ab_trees.py"]


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


def test_maintained_scripts_start():
    """``--help`` imports each script and everything it imports at start-up, and builds its argument parser
    (the scripts run side by side: each start is mostly the import of torch)."""
    procs = {script: subprocess.Popen([sys.executable, os.path.join(BENCH, script), "--help"], cwd=ROOT, env=_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for script in MAINTAINED}
    failed = {}
    for script, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failed[script] = out[-2000:]
    assert not failed, failed


def test_gpu_driver_script_parses():
    proc = subprocess.run(["bash", "-n", os.path.join(BENCH, "gpu_session.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_peers_read_the_batches_our_trainer_reads(corpus_prefix):
    """The peers' batches (bench/corpus.py) equal the micro-batches pretrain_gpt.py loads with the flags the
    benchmark gives it, iteration by iteration: same .bin/.idx, same split, seed and sample order."""
    sys.path.insert(0, BENCH)
    try:
        import gpu_throughput
        from corpus import batches
    finally:
        sys.path.remove(BENCH)
    import pretrain_gpt
    from megatron.core.datasets.samplers import build_pretraining_data_loader
    from megatron.core.parallel_state import ParallelState
    from megatron.training.arguments import parse_args

    iters, shape = 4, gpu_throughput.SHAPES["tiny"]
    cmd = gpu_throughput.ours_command(shape, iters - 1, 1, corpus_prefix, "")
    argv = cmd[cmd.index(os.path.join(ROOT, "pretrain_gpt.py")) + 1:]
    args = parse_args(argv)
    mb = shape["micro_batch_size"]
    train, _, _ = pretrain_gpt.datasets_provider(args, ParallelState.single(), (args.train_iters * mb, 0, 0))
    ours = iter(build_pretraining_data_loader(train, 0, mb, 0, 1, num_workers=0))
    peers = batches(corpus_prefix, shape["seq_length"], mb, iters, num_workers=0)
    seen = []
    for _ in range(iters):
        a, b = next(ours)["text"], next(peers)["text"]
        assert a.shape == (mb, shape["seq_length"] + 1)
        assert torch.equal(a, b)
        seen.append(a)
    # real text: many distinct tokens, and not the same sample over and over
    assert len(torch.unique(torch.cat(seen))) > 100
    assert not torch.equal(seen[0], seen[1])


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
