"""``--exit-signal-handler``: a signal asks the run to finish its iteration, save and exit with status 0.

The handler only records the signal; the training loop asks ``received()`` at the end of each iteration and all
ranks decide together (one rank receiving it is enough, e.g. when a scheduler signals one process per node).
SLURM's ``--signal=USR1@120`` pre-warning and ``srun``'s SIGTERM at the end of the time limit both land here.

A rank started by ``torchrun`` also stops when its launcher ends without stopping it (the launcher SIGKILLed, or
ended by a signal it does not forward, such as SIGUSR1): the kernel then sends the rank the exit signal (SIGTERM
without ``--exit-signal-handler``), so the ranks save and exit instead of training on as orphans.
"""

from __future__ import annotations

import signal
from typing import Optional

from megatron.core.process_tree import STOP_SIGNALS, die_with_parent, parent_pid_of_launcher

EXIT_SIGNALS = {s.name: s for s in STOP_SIGNALS}

_received: Optional[str] = None
_previous = None
_installed: Optional[str] = None


def _on_signal(signum, frame) -> None:
    global _received
    _received = signal.Signals(signum).name  # acted on at the end of the iteration in progress


def install(name: str) -> None:
    """Catch ``name`` (one of ``EXIT_SIGNALS``) from now on; ``release()`` restores the previous handler."""
    global _previous, _installed, _received
    release()
    _received = None
    _previous = signal.signal(EXIT_SIGNALS[name], _on_signal)
    _installed = name


def release() -> None:
    global _previous, _installed
    if _installed is not None:
        signal.signal(EXIT_SIGNALS[_installed], _previous if _previous is not None else signal.SIG_DFL)
    _previous, _installed = None, None


def received() -> Optional[str]:
    """The name of the exit signal if it arrived since ``install``, else None."""
    return _received


def stop_with_launcher() -> None:
    """Under ``torchrun``: the exit signal installed by ``install`` (else SIGTERM) arrives when the launcher ends."""
    launcher = parent_pid_of_launcher()
    if launcher is not None:
        die_with_parent(launcher, EXIT_SIGNALS[_installed] if _installed is not None else signal.SIGTERM)
