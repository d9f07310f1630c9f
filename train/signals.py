"""SIGTERM / SIGUSR1 / SIGUSR2 from the batch scheduler: note them, let the engine stop at a step boundary.

SLURM (``--signal``) and LSF (``-wa``) warn a job before its time limit with
SIGUSR1 (the scripts in bin/ requeue such a job). SIGTERM and SIGUSR2 mean
checkpoint and stop: SIGUSR2 is the one every launcher passes on to the ranks
as it is (Open MPI's ``mpirun`` turns a SIGTERM into SIGTERM + SIGKILL 250 ms
apart, too soon for a checkpoint; docs/batch-jobs.md). The
handler only records the signal; the engine puts the flag into the next
step's allreduce, so every rank learns of it after the same step, finishes
it, writes a checkpoint and returns. No rank is left inside a collective.

``dimd train`` installs one process-wide flag (:func:`install_stop_handlers`)
just before MPI starts and again right after it: MPI_Init puts its own C
handler on SIGUSR1 (MPICH's passes the signal on to the handler before it,
another MPI's may not), and a warning that arrives while the data loads must
not be lost. :func:`stop_request` hands the engine that flag; library callers
that installed none get a flag for the run only, as before.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


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

    def install(self) -> None:
        """Point the stop signals at this flag (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)  # the first: what __exit__ restores

    def __enter__(self) -> "StopRequest":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()


def first_signal(received: list[str | None]) -> str:
    """The stop signal to act on, from what each rank received (in rank order) by the step it stopped after.

    A scheduler's signal reaches the ranks of a job at slightly different
    times: one rank may hold it while another has nothing yet, so each rank
    says what it got and they all take the lowest rank's. ``bin/``'s scripts
    requeue on SIGUSR1 only, so a rank must not report "unknown" there.
    """
    return next(name for name in received if name is not None)


_process_stop: StopRequest | None = None


def install_stop_handlers() -> StopRequest:
    """The process-wide stop flag, (re)installed now; it stays until the process exits."""
    global _process_stop
    if _process_stop is None:
        _process_stop = StopRequest()
    _process_stop.install()
    return _process_stop


@contextlib.contextmanager
def stop_request() -> Iterator[StopRequest]:
    """The process-wide flag if one was installed, else a flag for this block only."""
    if _process_stop is not None:
        yield _process_stop
    else:
        with StopRequest() as stop:
            yield stop
