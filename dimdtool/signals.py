"""SIGTERM ends a command the way Ctrl-C does: one line, nothing left behind, workers gone.

A batch scheduler sends SIGTERM at the time limit (and ``kill`` sends it by
default). Python's default for it is to die at once: no ``finally`` runs, so
temporaries stay and a pool's worker processes run on. :func:`install`
makes SIGTERM raise :class:`Terminated` (a ``KeyboardInterrupt``) in the main
thread instead, so every cleanup that handles Ctrl-C handles it too. Forked
children (worker pools) get the default action back, so ``Pool.terminate()``
still ends them at once. A command that wants SIGTERM for itself (``train``
checkpoints and stops) installs its own handler over this one.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when a stop signal arrives; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: FrameType | None) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the cleanup short
    raise Terminated(signum)


def _default_in_child() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


_installed = False


def install() -> None:
    """SIGTERM -> :class:`Terminated` in this process (main thread only; idempotent)."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        return  # started with SIGTERM ignored (nohup-like): leave it so
    signal.signal(signal.SIGTERM, _raise)
    if not _installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_default_in_child)
    _installed = True


def interrupt_exit(exc: BaseException) -> tuple[str, int]:
    """The one line and the exit status for an interrupt: 130 for Ctrl-C, 128 + N for signal N."""
    if isinstance(exc, Terminated):
        return f"terminated ({signal.Signals(exc.signum).name})", 128 + exc.signum
    return "interrupted", 130
