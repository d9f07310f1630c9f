"""What a user's own training script starts with: MPI, threads and the device.

    import dimd
    comm, device = dimd.init()

:func:`init` is what ``dimd train`` does before it trains, for a script that
runs its own loop under ``mpiexec``: MPI at a thread level that lets
:class:`dimd.DistributedGradients` reduce on its communication thread, the
launch check that refuses N separate one-rank jobs, torch threads shared
out among the node's ranks, one GPU per rank, an exception hook that ends
the whole job (``MPI_Abort``) when one rank fails, so no rank is left waiting,
and a watch at exit for a rank whose script ended while others still wait
for it (``sys.exit`` on one rank, which no exception hook sees). The loader
a script reads its batches from is :func:`dimd.open_loader`
(:mod:`dimd.shuffle.loader`).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from typing import Any, NamedTuple

import torch

from dimd.errors import DimdError
from dimd.private_apis import abort_requested_at_exit, take_back_abort_at_exit
from dimd.stall import STALL_TIMEOUT_S, stall_timeout_problem
from dimd.mpi import (FORWARD_GRACE_S, AgreedError, LaunchMismatch, ThreadLevel, abort, init_mpi,
                      leaves_quietly)


class Job(NamedTuple):
    """What :func:`init` returns: ``comm, device = dimd.init()``."""

    comm: Any                 # mpi4py's COMM_WORLD
    device: torch.device


def init(*, device: str = "auto", threads: int | None = None,
         thread_level: ThreadLevel = "serialized", abort_on_error: bool = True,
         stall_timeout: float = STALL_TIMEOUT_S) -> Job:
    """Start MPI and pick this rank's device; collective, call it once before anything imports ``mpi4py.MPI``.

    ``device``: ``auto`` (one GPU per rank of the node when CUDA is there,
    else the CPU), ``cpu`` or ``cuda``. ``threads``: torch threads per rank
    (default: the node's cores shared by its ranks, or OMP_NUM_THREADS).
    ``thread_level``: ``serialized`` lets one communication thread call MPI
    while the main thread does not (what DistributedGradients needs); ask for
    ``multiple`` if the script calls MPI itself between backward and step.
    ``abort_on_error``: an uncaught exception on any rank prints its
    traceback (a :class:`DimdError`: one line, without a launcher too) and
    aborts every rank (one
    that every rank raised alike, an :class:`AgreedError`: rank 0 prints it
    and the ranks end in order, through ``MPI_Finalize``); and a
    rank whose script ends (its last line, or ``sys.exit`` on that rank
    alone) waits up to ``stall_timeout`` seconds for the others to end too,
    then ends the job with one line: a rank still waiting for it in a
    collective would otherwise wait for ever (0: no limit). When a
    launcher started N processes each in a world of one rank, none starts: the
    first prints one line and exits 1, the others exit 0 at once.
    """
    from dimd.train.hardware import pick_device, set_threads

    problem = stall_timeout_problem(stall_timeout)
    if problem:
        raise DimdError(problem)

    try:
        init_mpi(thread_level)
    except LaunchMismatch as exc:   # N processes that would each train alone: none may start
        if leaves_quietly(exc.first_task):
            sys.exit(0)
        sys.exit(f"dimd: error: {exc}")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if abort_on_error and comm.Get_size() == 1:   # `python my_script.py`: nothing to abort, the same one line
        sys.excepthook = _one_line_hook
    elif abort_on_error:
        sys.excepthook = _abort_job_hook(comm)
        # MPI: a communicator only the exit uses (Dup is collective); atexit runs this before mpi4py's MPI_Finalize
        atexit.register(_end_together, comm, comm.Dup(), stall_timeout)
    set_threads(threads, comm)   # MPI: the node's cores are shared by its ranks
    return Job(comm, pick_device(device, comm))


def _one_line_hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    """A one-rank script's uncaught :class:`DimdError` as one line; anything else as Python shows it."""
    if issubclass(kind, DimdError):
        sys.stderr.write(f"dimd: error: {error}\n")
        sys.stderr.flush()
    else:
        sys.__excepthook__(kind, error, trace)


def _abort_job_hook(comm: Any) -> Any:
    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if issubclass(kind, AgreedError):   # every rank raised it: one says it, and all leave in order
            if comm.Get_rank() == 0:
                sys.stderr.write(f"dimd: error: {error}\n")
                sys.stderr.flush()
            take_back_abort_at_exit()   # python -m mpi4py asked for MPI_Abort at exit: the ranks leave in order
            return   # exit status 1; the exit watch (_end_together) meets the others, then MPI_Finalize
        if issubclass(kind, DimdError):
            sys.stderr.write(f"dimd: error: rank {comm.Get_rank()}: {error}\n")   # one write, a whole line
        else:
            sys.stderr.write(f"rank {comm.Get_rank()}: " + "".join(traceback.format_exception(kind, error, trace)))
        sys.stderr.flush()
        time.sleep(FORWARD_GRACE_S)   # the launcher forwards the line before the abort tears it down
        abort(comm, 1)   # MPI: end every rank, none left waiting in a collective
    return hook


def _end_together(comm: Any, leaving: Any, timeout: float) -> None:
    """At this rank's exit: wait for every rank to exit too, or end the job after ``timeout`` seconds.

    A script that leaves on one rank (``sys.exit``, a ``break`` out of the
    loop that the others do not take) would otherwise hang the job: that
    rank's ``MPI_Finalize`` waits for the others, which wait in a collective
    for it. A barrier on ``leaving``, polled, tells the two apart.
    """
    from mpi4py import MPI

    if MPI.Is_finalized() or abort_requested_at_exit():   # python -m mpi4py's MPI_Abort ends the job at once
        return
    everyone = leaving.Ibarrier()   # MPI: every rank arrives here at its exit
    deadline = time.monotonic() + timeout if timeout else float("inf")
    while not everyone.Test():
        if time.monotonic() > deadline:
            sys.stdout.flush()
            sys.stderr.write(f"dimd: error: rank {comm.Get_rank()}: this rank's script ended, but after "
                             f"{timeout:g} s some ranks have not (they may wait for this one in a collective); "
                             f"ending the job (`stall_timeout` of dimd.init() sets the wait)\n")
            sys.stderr.flush()
            time.sleep(FORWARD_GRACE_S)
            try:
                abort(comm, 1)
            finally:   # MPICH's MPI_Abort may return when called at exit: no traceback after the line
                os._exit(1)
        time.sleep(0.01)
