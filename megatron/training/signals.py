"""``--exit-signal-handler``: a signal asks the run to finish its iteration, save and exit with status 0.

The handler only records the signal; the training loop asks ``received()`` at the end of each iteration and all
ranks decide together (one rank receiving it is enough, e.g. when a scheduler signals one process per node).
SLURM's ``--signal=USR1@120`` pre-warning and ``srun``'s SIGTERM at the end of the time limit both land here.
"""

from __future__ import annotations

import signal
from typing import Optional

EXIT_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGUSR1": signal.SIGUSR1,
                "SIGUSR2": signal.SIGUSR2}

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
