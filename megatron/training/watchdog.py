"""Stopping a run that cannot make progress, and saying why.

- ``SkippedIterationGuard``: too many consecutive skipped updates (a fixed fp16 loss scale that always overflows,
  a dynamic scale that collapsed, a gradient norm that stays non-finite) end the run with one line.
- ``Heartbeat``: every rank publishes a counter in the c10d store from a background thread; when a collective
  times out, the ranks still running read the counters and name the rank (host, pid, last iteration) whose
  counter stopped, instead of a bare timeout.
- ``describe_lost_peer``: when a collective fails because a peer's connection broke (the peer was killed), the
  one line naming the ranks whose process is gone (each rank's host and pid are read once at start, so this
  works even when the dead rank hosted the store).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, List, Optional

import torch.distributed as dist

from megatron.training.checkpoint_folder import pid_alive
from megatron.training.flag_table import SharedError


class SkippedIterationsError(SharedError):
    """--max-consecutive-skipped-iterations was reached (every rank sees the same skips, so all raise it)."""


class SkippedIterationGuard:
    """Counts consecutive iterations whose update was skipped; ``limit`` 0 never stops."""

    def __init__(self, limit: int, fp16: bool, fixed_loss_scale: Optional[float], min_loss_scale: float):
        self.limit, self.fp16 = limit, fp16
        self.fixed_loss_scale, self.min_loss_scale = fixed_loss_scale, min_loss_scale
        self.consecutive = 0

    def update(self, iteration: int, update_ok: bool, loss_scale: float) -> None:
        """Called once per iteration after the optimizer step; raises when the limit is reached."""
        self.consecutive = 0 if update_ok else self.consecutive + 1
        if not self.limit or self.consecutive < self.limit:
            return
        if not self.fp16:
            why = "the gradient norm was not finite"
            hint = "the model diverged: resume from an earlier checkpoint with a lower --lr"
        elif self.fixed_loss_scale is not None:
            why = f"the gradients overflowed fp16 at the fixed loss scale {loss_scale:g}"
            hint = "use a smaller --loss-scale or leave it out for dynamic scaling"
        elif loss_scale <= self.min_loss_scale:
            why = f"the gradients overflowed fp16 even at the dynamic loss scale's minimum {loss_scale:g}"
            hint = "the model diverged: resume from an earlier checkpoint with a lower --lr, or use --bf16"
        else:
            why = f"the gradients overflowed fp16 (dynamic loss scale now {loss_scale:g})"
            hint = "raise the limit if the scale is still coming down from --initial-loss-scale"
        raise SkippedIterationsError(
            f"iteration {iteration}: {self.consecutive} consecutive iterations skipped their update ({why}); "
            f"stopping without saving (--max-consecutive-skipped-iterations {self.limit}); {hint}")


# ---- heartbeats -------------------------------------------------------------------------------------------
_PREFIX = "megatron-lite/heartbeat"
_current: Optional["Heartbeat"] = None


def _print_error(line: str) -> None:
    print(f"error: {line}", file=sys.stderr, flush=True)


class Heartbeat:
    """This rank's liveness in the process group's store.

    At start ``rank/R/who`` holds ``{"host", "pid"}``; a daemon thread then writes ``rank/R/beat`` =
    ``"COUNT ITERATION"`` every ``interval`` seconds through its own connection to the store. A rank that is
    frozen (SIGSTOP, a stuck driver call that holds the interpreter) or dead stops counting; a rank that waits in a
    collective keeps counting (collectives release the interpreter lock while they wait).

    ``report_stalls`` (for backends whose timeout ends the process instead of raising, NCCL): when this rank's
    iteration has not moved for 0.8 of the timeout, the thread compares the other ranks' counters over
    2.5 beats and, if some stopped, calls ``on_stall(line)`` once (default: print an ``error:`` line).
    """

    def __init__(self, interval: float, timeout_minutes: float, report_stalls: bool = False,
                 on_stall: Callable[[str], None] = _print_error):
        global _current
        if _current is not None:
            _current.stop()
        self.interval, self.timeout_minutes = interval, timeout_minutes
        self.report_stalls, self.on_stall = report_stalls, on_stall
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
        self.store.set(f"rank/{self.rank}/who", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self.iteration = 0  # set by the training loop; read by the thread
        self.peers: dict = {}  # {rank: {"host", "pid"}}, filled by the thread as the ranks publish theirs
        self.store.set(f"rank/{self.rank}/beat", "0 0")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()
        _current = self

    def _client(self):
        """A connection of its own to the store: never queued behind the main thread's calls."""
        try:
            store = self.store.clone()
        except (RuntimeError, AttributeError):
            return self.store
        store.set_timeout(timedelta(seconds=10))
        return store

    def _beat(self) -> None:
        try:
            store = self._client()
        except (RuntimeError, OSError):
            return
        start = time.monotonic()
        count, last_iteration, changed_at, check_from, pending, reported = 0, self.iteration, start, start, None, False
        while not self._stop.is_set():
            count += 1
            try:
                if len(self.peers) < self.world:
                    self._learn_peers(store)
                store.set(f"rank/{self.rank}/beat", f"{count} {self.iteration}")
                now = time.monotonic()
                if self.iteration != last_iteration:
                    last_iteration, changed_at, check_from, pending = self.iteration, now, now, None
                elif self.report_stalls and not reported and pending is None and \
                        now - check_from > 0.8 * self.timeout_minutes * 60.0:
                    pending = (now, self._snapshot(store))
                elif pending is not None and now - pending[0] >= 2.5 * self.interval:
                    stalled = self._compare(store, pending[1], now - pending[0])
                    pending, check_from = None, now
                    if stalled:
                        reported = True
                        self.on_stall(f"{_name_ranks(stalled)}; rank {self.rank} has made no progress for "
                                      f"{now - changed_at:.0f} s (the job ends at --distributed-timeout-minutes "
                                      f"{self.timeout_minutes:g})")
            except (RuntimeError, OSError):  # the store went away (the job is ending)
                return
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()

    def _learn_peers(self, store) -> None:
        """Add the hosts and pids of the ranks that have published theirs since the last beat (a rank slow to
        start is named once it has); the dict is replaced whole, as other threads read it."""
        new = {}
        for r in range(self.world):
            if r not in self.peers:
                who = self._read(store, r, "who")
                try:
                    if who is not None:
                        new[r] = json.loads(who)
                except ValueError:  # not ours to read: that rank is named by its heartbeat alone
                    continue
        if new:
            self.peers = {**self.peers, **new}

    def _read(self, store, rank: int, key: str) -> Optional[str]:
        name = f"rank/{rank}/{key}"
        if not store.check([name]):
            return None
        return store.get(name).decode()

    def _snapshot(self, store) -> dict:
        return {r: self._read(store, r, "beat") for r in range(self.world) if r != self.rank}

    def _compare(self, store, first: dict, waited: float) -> List[dict]:
        out = []
        for r, before in first.items():
            now = self._read(store, r, "beat")
            if now is not None and now != before:
                continue
            who = json.loads(self._read(store, r, "who") or "{}")
            out.append({"rank": r, "host": who.get("host", "?"), "pid": who.get("pid", "?"),
                        "iteration": None if now is None else int(now.split()[1]), "silent_s": waited})
        return out

    def stalled_ranks(self) -> List[dict]:
        """The ranks (other than this one) whose heartbeat does not move over ``2.5 * interval``: each as
        ``{"rank", "host", "pid", "iteration", "silent_s"}``. This rank's own thread keeps beating meanwhile, so
        ranks that check at the same moment do not take each other for stalled. Raises ``RuntimeError`` if the
        store does not answer."""
        store = self._client()
        first = self._snapshot(store)
        wait = 2.5 * self.interval
        time.sleep(wait)
        return self._compare(store, first, wait)


def _name_ranks(stalled: List[dict]) -> str:
    names = "; ".join(
        f"rank {s['rank']} (host {s['host']}, pid {s['pid']}"
        + (f", last at iteration {s['iteration']}" if s["iteration"] is not None else ", never started")
        + ")" for s in stalled)
    verb = "has" if len(stalled) == 1 else "have"
    return f"{names} {verb} stopped responding (no heartbeat for {round(stalled[0]['silent_s'], 1):g} s)"


def start_heartbeat(timeout_minutes: float, backend: str) -> Optional[Heartbeat]:
    """A heartbeat for this process group (None for a single process): a beat every 2 s (every world / 1000 s
    beyond 2,000 ranks, so the store sees at most about 1,000 writes a second), and at least 10 beats per timeout.
    Under NCCL, whose timeout ends the process without raising, the thread itself reports."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    interval = min(timeout_minutes * 60.0 / 10.0, max(2.0, dist.get_world_size() / 1000.0))
    return Heartbeat(interval=interval, timeout_minutes=timeout_minutes, report_stalls=(backend == "nccl"))


def stop_heartbeat() -> None:
    if _current is not None:
        _current.stop()


def progress(iteration: int) -> None:
    """The training loop's iteration in progress, published with the next beat."""
    if _current is not None:
        _current.iteration = iteration


def describe_timeout(rank: int, error: str) -> str:
    """The one line a rank prints when its collective timed out (gloo raises): who stopped responding, as far as
    the heartbeats tell."""
    beat = _current
    if beat is None:
        return (f"a collective on rank {rank} waited longer than --distributed-timeout-minutes (another rank "
                f"stopped or died): {error}")
    base = f"rank {rank} waited in a collective longer than --distributed-timeout-minutes {beat.timeout_minutes:g}"
    try:
        stalled = beat.stalled_ranks()
    except (RuntimeError, OSError) as exc:
        return f"{base}; the heartbeats could not be read ({str(exc).splitlines()[0]}): {error}"
    if not stalled:
        return (f"{base}, but every rank's heartbeat is alive: the ranks are waiting in different collectives "
                f"(a deadlock, not a frozen rank): {error}")
    return f"{_name_ranks(stalled)}; {base}"


# gloo's messages when a peer's socket closes under it (the peer process died, or its host went away)
_LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Connection refused|Socket closed|"
                        r"Read error|Write error|Connection timed out", re.IGNORECASE)


def is_lost_peer(error: str) -> bool:
    """Whether a collective's error says a peer's connection broke."""
    return bool(_LOST_PEER.search(error))


def describe_lost_peer(rank: int, error: str) -> str:
    """The one line a rank prints when a collective failed because a peer's connection broke: the ranks of this
    host whose process is gone (from the hosts and pids published at start), else the ranks whose heartbeat
    stopped, else the error itself."""
    beat = _current
    base = f"rank {rank} lost its connection to a peer in a collective ({error})"
    if beat is None:
        return base
    here = socket.gethostname()
    local = {r: int(who.get("pid", 0)) for r, who in beat.peers.items() if r != rank and who.get("host") == here}
    dead: List[int] = []
    deadline = time.monotonic() + 3.0  # a killed process closes its sockets a moment before it is gone
    while local and not dead and time.monotonic() < deadline:
        dead = sorted(r for r, pid in local.items() if not pid_alive(pid))
        if not dead:
            time.sleep(0.1)
    if dead:
        names = "; ".join(f"rank {r} (host {beat.peers[r]['host']}, pid {beat.peers[r]['pid']})" for r in dead)
        verb = "has" if len(dead) == 1 else "have"
        return f"{names} {verb} died (the process is gone); {base}"
    try:
        stalled = beat.stalled_ranks()
    except (RuntimeError, OSError):
        stalled = []
    if stalled:
        return f"{_name_ranks(stalled)}; {base}"
    return base
