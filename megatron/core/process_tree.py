"""A training process's children live and die with it.

SLURM, systemd, Kubernetes and ``torchrun`` stop a job by signalling whole process groups, so a trainer's
DataLoader workers receive the same SIGTERM (or SIGUSR1, SIGINT) as the trainer. A worker killed by it makes the
trainer fail (``DataLoader worker ... is killed by signal``) before it can save. Workers therefore ignore the
signals that ask a run to stop (``ignore_stop_signals``): the trainer decides, and shuts its loaders down itself.
(PyTorch's worker loop installs a handler for SIGTERM that prints a message and dies; the ``worker_init_fn``
runs after it and replaces it. The trainer's SIGCHLD handler is what turns a worker's death into the error.)

The reverse must hold too: a worker (or a rank under a launcher) whose parent was SIGKILLed would otherwise live
on, holding the parent's files, sockets and the run lock (PyTorch's workers notice a dead parent only at their
next 5 s status check). ``die_with_parent`` asks the Linux kernel to deliver a
signal when the parent dies (``prctl(PR_SET_PDEATHSIG)``), and checks that the parent did not die before that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from typing import Optional

# The signals a scheduler or a user sends to ask a run to stop (the choices of --exit-signal).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

_PR_SET_PDEATHSIG = 1
_libc = None


def ignore_stop_signals() -> None:
    """From now on this process ignores ``STOP_SIGNALS`` (for a child whose parent decides when to stop)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent (``parent_pid``) ends.

    Linux only (returns False elsewhere, or when ``prctl`` is unavailable). If the parent already ended before
    the request was made (this process was re-parented), ``signum`` is raised at once. The kernel ties the
    request to the parent *thread* that created this process: call it in children created by a parent's main
    thread (DataLoader workers, ``torchrun``'s ranks).
    """
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if _libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)
    return True


def parent_pid_of_launcher() -> Optional[int]:
    """The launcher's pid when this process is a rank started by ``torchrun`` (its parent), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return os.getppid()
