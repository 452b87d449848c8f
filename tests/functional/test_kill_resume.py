"""Seeded SIGKILL/resume: a run killed again and again (during start-up, between iterations and in the middle
of checkpoint saves) and resumed each time with ``--load`` reproduces an uninterrupted run bit for bit, with
dropout on: every iteration any resumed process runs has the same loss and gradient norm, compared as exact
float bits."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

from tests.functional.harness import ROOT, gpt_args

# Runs pretrain_gpt.py unchanged and appends the exact bits of the iteration's loss and gradient norm to each
# iteration line (the log prints 6 digits, which cannot show a difference in the last bit).
DRIVER = """
import runpy, sys
import megatron.training.training as training
plain = training.format_iteration_line

def exact(iteration, train_iters, consumed, elapsed_ms, lr, global_batch, losses, loss_scale, grad_norm, *rest):
    line = plain(iteration, train_iters, consumed, elapsed_ms, lr, global_batch, losses, loss_scale, grad_norm, *rest)
    if "lm loss" not in losses:  # a rank before the last pipeline stage: the last stage prints the line
        return line
    return line + f" exact {iteration} {float(losses['lm loss']).hex()} {float(grad_norm).hex()}"

training.format_iteration_line = exact
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
TRAIN_ITERS, SAVE_INTERVAL, KILLS, SEED = 16, 2, 10, 20261202


def _args(data_prefix, **extra):
    # dropout on (the harness default is off); one iteration line per iteration
    return gpt_args(data_prefix, train_iters=TRAIN_ITERS, hidden_dropout=0.1, attention_dropout=0.1, **extra)


def _exact_lines(stdout):
    out = []
    for line in stdout.splitlines():
        if " exact " in line:
            it, loss, norm = line.rsplit(" exact ", 1)[1].split()
            out.append((int(it), loss, norm))
    return out


class _Run:
    """One pretrain_gpt.py process whose stdout lines are read as they come."""

    def __init__(self, driver, argv):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
        self.proc = subprocess.Popen([sys.executable, driver, os.path.join(ROOT, "pretrain_gpt.py")] + argv,
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines, self.event = [], threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.event.set()
        self.event.set()

    def wait_for_iteration(self, predicate, deadline):
        """Block until an iteration line whose number satisfies ``predicate`` arrives (or the process ends)."""
        while time.time() < deadline:
            for line in list(self.lines):
                if " exact " in line and predicate(int(line.rsplit(" exact ", 1)[1].split(" ")[0])):
                    return True
            if self.proc.poll() is not None and not self.reader.is_alive():
                return False
            self.event.wait(0.005)
            self.event.clear()
        return False

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        return self.finish()

    def finish(self):
        self.proc.wait(timeout=300)
        self.reader.join(timeout=30)
        return "".join(self.lines), self.proc.stderr.read()


def _save_in_flight(ckpt):
    """True when a killed save left its traces: a temporary file, or an iteration folder without manifest."""
    for root, dirs, files in os.walk(ckpt):
        if any(".tmp." in f for f in files):
            return True
        if os.path.basename(root).startswith("iter_") and "manifest.json" not in files:
            return True
    return False


def test_sigkill_at_random_points_then_resume_is_bit_exact(data_prefix, tmp_path):
    driver = str(tmp_path / "driver.py")
    with open(driver, "w") as f:
        f.write(DRIVER)
    straight = _Run(driver, _args(data_prefix))
    out, err = straight.finish()
    assert straight.proc.returncode == 0, err[-3000:]
    reference = {it: (loss, norm) for it, loss, norm in _exact_lines(out)}
    assert sorted(reference) == list(range(1, TRAIN_ITERS + 1))

    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    argv = _args(data_prefix, save=ckpt, load=ckpt, save_interval=SAVE_INTERVAL)
    rng = random.Random(SEED)
    seen, kinds, during_save = [], [], 0
    while len(kinds) < KILLS:
        tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
        start = int(open(tracker).read()) if os.path.exists(tracker) else 0
        if start >= TRAIN_ITERS - SAVE_INTERVAL:  # keep iterations to kill in: start over in a fresh folder
            ckpt_old = ckpt
            ckpt = str(tmp_path / f"ckpt{len(kinds)}")
            os.makedirs(ckpt)
            argv = [ckpt if a == ckpt_old else a for a in argv]
            continue
        run = _Run(driver, argv)
        kind = rng.choice(["start-up", "iteration", "save", "save"])
        deadline = time.time() + 120
        if kind == "start-up":  # somewhere between launch and the first iteration (at the latest)
            run.wait_for_iteration(lambda it: True, time.time() + rng.uniform(0.5, 4.0))
        else:
            target = start + rng.randint(1, TRAIN_ITERS - start - 1)
            if kind == "save":  # the save starts right after the line of an iteration that is a save point
                target = min(TRAIN_ITERS - 1, target + (-target) % SAVE_INTERVAL)
            assert run.wait_for_iteration(lambda it: it >= target, deadline), "".join(run.lines)[-3000:]
            if kind == "iteration":
                time.sleep(rng.uniform(0.0, 0.2))
        if run.proc.poll() is not None:  # finished first (a fast machine): its iterations still count, not its kill
            out, err = run.finish()
            assert run.proc.returncode == 0, f"{out[-2000:]}\n{err[-2000:]}"
            seen.extend(_exact_lines(out))
            continue
        out, _ = run.kill()
        kinds.append(kind)
        during_save += _save_in_flight(ckpt)
        seen.extend(_exact_lines(out))
    final = _Run(driver, argv)
    out, err = final.finish()
    assert final.proc.returncode == 0, err[-3000:]
    seen.extend(_exact_lines(out))

    assert len(kinds) >= 10 and kinds.count("save") >= 3, kinds
    assert during_save >= 1, f"no kill landed inside a save ({kinds})"
    assert {it for it, _, _ in seen} >= set(range(TRAIN_ITERS // 2, TRAIN_ITERS + 1))
    for it, loss, norm in seen:  # every iteration any process ran, resumed ones included
        assert (loss, norm) == reference[it], f"iteration {it}: {(loss, norm)} vs uninterrupted {reference[it]}"
    assert not any(".tmp." in f for _, _, files in os.walk(ckpt) for f in files)  # stale temp files removed
    assert not os.path.exists(os.path.join(ckpt, "run.lock"))  # the killed runs' locks were taken over
