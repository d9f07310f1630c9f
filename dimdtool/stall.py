"""The stall watchdog: a job whose peer is gone ends with one line instead of waiting forever.

A rank in a collective (a step's allreduce, the shuffle's Alltoallv, the
evaluation's sums) waits for every other rank. When a peer's node dies or its
network goes, nothing times that wait out: the ranks and MPICH's Hydra wait on
TCP sockets with no deadline. The main thread cannot notice (it is inside the
MPI call), so a thread of its own does: the main thread marks each wait
(:meth:`StallWatchdog.waiting`), and when one lasts longer than the timeout the
watchdog reports it (:func:`end_job`: one line naming the rank, its host and the
wait, then the whole job ends).

How :func:`end_job` ends every process was found on two network-namespace
hosts, one cut off mid-training (docs/mpi.md#a-host-that-dies-mid-job):
``os._exit`` alone leaves ``mpiexec`` on the surviving host waiting for the
cut-off host's proxy forever; ``MPI_Abort`` reaches the rank's own launcher
process, so on the launcher's side ``mpiexec`` ends what it can reach and exits,
but on the cut-off side it never returns (the abort waits for a launcher it
cannot reach). So :func:`end_job` calls ``MPI_Abort`` and a timer ends the
process with ``os._exit`` shortly after, whichever side of the cut it is on.

Open MPI's runtime (PRRTE) needs one step more. After ``MPI_Abort`` its
launcher (``prterun``, started as ``mpirun``) waits for every host's daemon
(``prted``) to report its ranks ended, and a daemon on a host that left the
network never does: ``mpirun`` waited until the kernel gave up on their TCP
connection (949 s on the namespace hosts, then exit status 0), and the lost
host's daemon as long for ``mpirun``. A third stop signal makes either leave at
once (PRRTE's "hit ctrl-c again to forcibly terminate"). So a rank whose
parent is one of them leaves behind a small process of its own
(:func:`stop_a_stuck_runtime`) that stops it so if it has not ended
:data:`PRRTE_GRACE_S` after the abort; ``mpirun`` then exits with status 1.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

from dimd.mpi import FORWARD_GRACE_S, abort
from dimd.wording import name_settings

#: After MPI_Abort: a rank whose abort cannot reach its launcher (the host is cut off) ends by itself.
_EXIT_AFTER_ABORT_S = 3.0
#: Open MPI's runtime processes that may parent a rank: its launcher and its daemon on the other hosts.
PRRTE_PROCESSES = frozenset({"prterun", "mpirun", "prted"})
#: How long after MPI_Abort a PRRTE process may take to end the job itself (it takes a second or two).
PRRTE_GRACE_S = 10.0
#: A process of its own (argv: a pidfd, the grace): three SIGTERMs a second apart, unless the process ends first.
_PRRTE_STOPPER = """
import select, signal, sys
process, grace = int(sys.argv[1]), float(sys.argv[2])
for wait in (grace, 1.0, 1.0):
    if select.select([process], [], [], wait)[0]:
        break
    try:
        signal.pidfd_send_signal(process, signal.SIGTERM)
    except ProcessLookupError:
        break
"""
#: What ends a stalled job names: the setting (`stall_timeout` for a library caller, its flag under a command).
STALL_HINT = "`stall_timeout` sets how long a rank waits for the others; 0 waits forever"
#: How long a rank of an MPI command waits for the others by default (their `stall_timeout`): long enough
#: for a rank's lead over the slowest, or rank 0's checkpoint write, short of a batch job's time limit.
STALL_TIMEOUT_S = 600.0


class StallWatchdog:
    """A thread that calls ``on_stall(message)`` once when a marked wait outlasts ``timeout`` seconds.

    ``timeout`` 0 turns it off (no thread). ``clock`` is for tests. Use it as
    a context manager around the run, and :meth:`waiting` around each wait::

        with StallWatchdog(600, job_ender(comm)) as watchdog:
            with watchdog.waiting("the allreduce of step 12"):
                allreduce(gradients, comm)
    """

    def __init__(self, timeout: float, on_stall: Callable[[str], None], *,
                 clock: Callable[[], float] = time.monotonic, poll: float | None = None) -> None:
        self.timeout = timeout
        self._on_stall = on_stall
        self._clock = clock
        self._poll = poll if poll is not None else min(5.0, max(timeout / 10, 0.01))
        self._what: str | None = None
        self._since = 0.0
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Mark a wait for the other ranks (``what`` names it in the line: "the allreduce of step 12")."""
        self._since = self._clock()   # first the start, then the name: the watchdog reads them the other way
        self._what = what
        try:
            yield
        finally:
            self._what = None

    def stalled(self) -> str | None:
        """The line to report if the wait in progress has outlasted the timeout, else None."""
        what, since = self._what, self._since
        if what is None or not self.timeout:
            return None
        waited = self._clock() - since
        if waited < self.timeout:
            return None
        return f"no progress for {waited:.0f} s in {what}; a peer may be unreachable"

    def _watch(self) -> None:
        while not self._closing.wait(self._poll):
            message = self.stalled()
            if message is not None:
                self._on_stall(message)
                return

    def __enter__(self) -> "StallWatchdog":
        self._closing.clear()   # a watchdog may watch one run after another
        if self.timeout:
            self._thread = threading.Thread(target=self._watch, name="dimd-stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def stall_timeout_problem(timeout: float) -> str | None:
    """Why ``timeout`` is no stall timeout for a library caller (a negative or infinite one), or None."""
    if 0 <= timeout < float("inf"):
        return None
    return f"stall_timeout must be 0 (wait for ever) or more seconds, got {timeout}"


def watch_job(comm: Any, timeout: float) -> StallWatchdog:
    """The watchdog of a job on ``comm`` that ends it (:func:`job_ender`); off for one rank, who waits for nobody.

    Enter it once the waits that may legitimately take any time (the load's reads) are over.
    """
    return StallWatchdog(timeout if comm.Get_size() > 1 else 0, job_ender(comm))


def job_ender(comm: Any, code: int = 1) -> Callable[[str], None]:
    """``on_stall`` for a job on ``comm``: :func:`end_job` with a hint on the timeout's setting."""
    return lambda message: end_job(comm, f"{message} ({STALL_HINT})", code)


def end_job(comm: Any, message: str, code: int = 1) -> None:
    """From the watchdog's thread: print ``message`` with this rank and host, then end every process of the job.

    MPI_Abort from a thread other than the one inside the collective breaks
    THREAD_SERIALIZED's promise (one thread in MPI at a time), and the MPI
    standard leaves that undefined; MPICH's abort takes no lock at that level and
    goes straight to its launcher. The os._exit timer ends the rank either way:
    where the abort cannot reach the launcher, or where an MPI would not return.
    """
    where = f"rank {comm.Get_rank()} on {socket.gethostname()}"
    sys.stderr.write(f"dimd: error: {where}: {name_settings(message)}\n")   # the running command's flags
    sys.stderr.flush()
    sys.stdout.flush()
    timer = threading.Timer(FORWARD_GRACE_S + _EXIT_AFTER_ABORT_S, os._exit, args=(code,))
    timer.daemon = True
    timer.start()
    stop_a_stuck_runtime()
    time.sleep(FORWARD_GRACE_S)
    abort(comm, code)


def stop_a_stuck_runtime(parent: int | None = None, grace: float = PRRTE_GRACE_S) -> subprocess.Popen | None:
    """Where this rank's parent (or ``parent``) is Open MPI's launcher or daemon: a process in a session of its
    own (the abort ends this rank's process group) that stops it with three SIGTERMs, a second apart, unless it
    ends within ``grace`` seconds (see the module's docstring). Returns that process, or None."""
    parent = os.getppid() if parent is None else parent
    try:
        with open(f"/proc/{parent}/comm") as comm_file:
            if comm_file.read().strip() not in PRRTE_PROCESSES:
                return None
        process = os.pidfd_open(parent)   # the same process to the end, whatever pid comes to be reused
    except (OSError, AttributeError):     # gone, or no /proc or pidfd (not Linux): nothing to stop
        return None
    try:
        return subprocess.Popen([sys.executable, "-S", "-I", "-c", _PRRTE_STOPPER, str(process), str(grace)],
                                pass_fds=(process,), start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None
    finally:
        os.close(process)
