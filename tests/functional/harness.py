"""Run pretrain_gpt.py (plain or under torchrun, gloo on CPU) and read its iteration log lines."""

from __future__ import annotations

import os
import re
import socket
import json
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([-+0-9.eE]+|nan|inf) \|.*? loss scale: ([0-9.]+) \|"
                  r"(?: grad norm: ([-+0-9.eE]+|nan|inf) \|)? number of skipped iterations:\s+(\d+) \|"
                  r" number of nan iterations:\s+(\d+) \|")


def preprocess_quickstart_corpus(out_dir: str) -> str:
    """Tokenise the bundled corpus with the GPT-2 BPE; returns the dataset prefix."""
    prefix = os.path.join(out_dir, "corpus")
    if not os.path.exists(prefix + "_text_document.idx"):
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools/preprocess_data.py"), "--input",
             os.path.join(ROOT, "data/tinyshakespeare.jsonl.gz"), "--output-prefix", prefix,
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(ROOT, "data/gpt2-vocab.json"),
             "--merge-file", os.path.join(ROOT, "data/gpt2-merges.txt"), "--append-eod", "--workers", "1"],
            check=True, capture_output=True, text=True)
    return prefix + "_text_document"


def gpt_args(data_prefix: str, tp: int = 1, **overrides) -> List[str]:
    """A tiny fp32, dropout-free GPT whose padded vocabulary is the same at every TP size."""
    opts: Dict[str, object] = {
        "num-layers": 4, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32,
        "max-position-embeddings": 32, "micro-batch-size": 2, "global-batch-size": 8, "train-iters": 10,
        "lr": 3e-3, "min-lr": 3e-4, "lr-decay-style": "cosine", "lr-warmup-iters": 2, "weight-decay": 0.1,
        "clip-grad": 1.0, "attention-dropout": 0.0, "hidden-dropout": 0.0, "seed": 1234, "log-interval": 1,
        "eval-iters": 0, "make-vocab-size-divisible-by": 512 // tp, "tensor-model-parallel-size": tp,
        "data-path": data_prefix, "split": "98,2,0", "vocab-file": os.path.join(ROOT, "data/gpt2-vocab.json"),
        "merge-file": os.path.join(ROOT, "data/gpt2-merges.txt"), "num-workers": 0, "attention-backend": "unfused",
    }
    opts.update({k.replace("_", "-"): v for k, v in overrides.items()})
    argv: List[str] = []
    for key, value in opts.items():
        if value is None or value is False:
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.append(str(value))
    return argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pretrain(argv: List[str], nproc: int = 1, timeout: int = 600, expect_ok: bool = True,
                 script: str = "pretrain_gpt.py", env: Optional[dict] = None,
                 launcher: str = "torch.distributed.run") -> subprocess.CompletedProcess:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", launcher, "--nproc_per_node", str(nproc), "--master_port", str(_free_port())]
    cmd += [os.path.join(ROOT, script)] + argv
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}  # env may override
    full_env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def parse_iterations(stdout: str) -> Dict[int, dict]:
    """{iteration: {"lm loss", "loss scale", "grad norm", "skipped", "nan"}} from the log lines."""
    out = {}
    for m in LINE.finditer(stdout):
        out[int(m.group(1))] = {
            "lm loss": float(m.group(2)), "loss scale": float(m.group(3)),
            "grad norm": None if m.group(4) is None else float(m.group(4)),
            "skipped": int(m.group(5)), "nan": int(m.group(6)),
        }
    return out


def losses(argv: List[str], nproc: int = 1, **kw) -> Dict[int, dict]:
    proc = run_pretrain(argv, nproc=nproc, **kw)
    its = parse_iterations(proc.stdout)
    if not its:
        raise AssertionError(f"no iteration lines in output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return its


def outputs_of_many(argvs: Sequence[List[str]], nproc: int = 1, script: str = "pretrain_gpt.py",
                    timeout_per_run: int = 600, driver: Optional[str] = None) -> List[str]:
    """The standard output of each run (all ranks), from one launch that runs them one after another
    (tests/functional/run_many.py): one start-up of Python, torch and the process group for all of them. Every
    run must succeed; the first failure raises with that run's output. The launch may take ``timeout_per_run``
    seconds per run, as many as separate launches would. ``driver``: a Python file that launches the program its
    arguments name (as ``python driver.py run_many.py JOBS.json``), to change what the runs print."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = [{"argv": list(argv), "out": os.path.join(tmp, f"run{i}")} for i, argv in enumerate(argvs)]
        jobs = os.path.join(tmp, "jobs.json")
        with open(jobs, "w") as f:
            json.dump({"script": script, "runs": runs}, f)
        many = os.path.join(ROOT, "tests", "functional", "run_many.py")
        proc = run_pretrain([many, jobs] if driver else [jobs], nproc=nproc, timeout=timeout_per_run * len(argvs),
                            expect_ok=False, script=driver or many, env={"PYTHONPATH": ROOT} if driver else None)

        def read(run: dict, suffix: str) -> Optional[str]:
            parts = []
            for rank in range(nproc):
                path = f"{run['out']}.rank{rank}.{suffix}"
                if os.path.exists(path):
                    with open(path) as f:
                        parts.append(f.read())
            return "".join(parts) if parts else None

        outputs = []
        for argv, run in zip(argvs, runs):
            stdout, stderr = read(run, "stdout"), read(run, "stderr")
            if stdout is None or "Traceback" in (stderr or ""):
                raise AssertionError(f"run {' '.join(argv)} (nproc {nproc}) failed ({proc.returncode}):\n"
                                     f"{(stdout or '')[-3000:]}\n{(stderr or '')[-5000:]}\n"
                                     f"launcher:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            outputs.append(stdout)
        if proc.returncode != 0:
            raise AssertionError(f"the launch of {len(argvs)} runs failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}")
        return outputs


def losses_of_many(argvs: Sequence[List[str]], nproc: int = 1, **kw) -> List[Dict[int, dict]]:
    """``[losses(argv, nproc) for argv in argvs]`` from one launch (see ``outputs_of_many``)."""
    results = []
    for argv, stdout in zip(argvs, outputs_of_many(argvs, nproc=nproc, **kw)):
        its = parse_iterations(stdout)
        if not its:
            raise AssertionError(f"no iteration lines in the output of {' '.join(argv)}:\n{stdout[-3000:]}")
        results.append(its)
    return results


class RunCache:
    """Loss curves of the session's training runs, each computed once: ``losses({name: (nproc, argv)})`` launches
    the runs not yet computed together, one launch per world size, and returns ``{name: losses}``."""

    def __init__(self):
        self._done: Dict[Tuple[int, Tuple[str, ...]], Dict[int, dict]] = {}

    def losses(self, jobs: Dict[str, Tuple[int, List[str]]], launch_each: bool = False) -> Dict[str, Dict[int, dict]]:
        """``launch_each``: every run in a process of its own (FP8 delayed scaling keeps one registry of scaling
        sites per process, so a process trains one such model)."""
        todo: Dict[int, List[Tuple[str, ...]]] = {}
        for nproc, argv in jobs.values():
            key = tuple(argv)
            if (nproc, key) not in self._done and key not in todo.setdefault(nproc, []):
                todo[nproc].append(key)
        for nproc, argvs in sorted(todo.items()):
            groups = [[a] for a in argvs] if launch_each else [argvs] if argvs else []
            for group in groups:
                for argv, its in zip(group, losses_of_many([list(a) for a in group], nproc=nproc)):
                    self._done[(nproc, argv)] = its
        return {name: self._done[(nproc, tuple(argv))] for name, (nproc, argv) in jobs.items()}


def assert_same_losses(a: Dict[int, dict], b: Dict[int, dict], rel: float = 1e-5, keys=("lm loss",)) -> None:
    """Every iteration's values agree to ``rel`` relative difference (5 significant digits by default)."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for it in sorted(a):
        for key in keys:
            x, y = a[it][key], b[it][key]
            assert abs(x - y) <= rel * max(abs(x), abs(y)), f"iteration {it} {key}: {x} vs {y}"
