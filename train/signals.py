"""SIGTERM / SIGUSR1 from the batch scheduler: note them, let the engine stop at a step boundary.

SLURM (``--signal``) and LSF (``-wa``) warn a job before its time limit. The
handler only records the signal; the engine puts the flag into the next
step's allreduce, so every rank learns of it after the same step, finishes
it, writes a checkpoint and returns. No rank is left inside a collective.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """A context manager that turns the stop signals into a flag (and restores the old handlers)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    def __bool__(self) -> bool:
        return self.received is not None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
