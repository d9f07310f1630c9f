"""Run a click command under MPI so that an error on any rank ends the whole job.

The wrapped callback receives ``comm`` and ``mpi_setup``. Before it runs,
rank 0 checks the command's output locations (every option of type
:class:`dimd.options.OutputPath`) and all ranks agree on the outcome, so a
bad ``--json`` path fails the job at start-up with one line. A
:class:`DimdError` becomes a one-line message, any other exception a
traceback; then the job is aborted (``MPI_Abort``), so no rank is left
waiting in a collective. An error every rank raised together
(:class:`dimd.mpi.AgreedError`: an output path, a data set, a checkpoint, or
a usage error such as an option's value that its config refuses) ends the
job in order instead: one line, then every rank exits through
``MPI_Finalize``. A launch that gave every process a world of its
own (plain ``srun`` without a PMI) stops at once, with one line from the
launcher's first process.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from typing import Any, Callable

import click

from dimd.console import write_line
from dimd.errors import DimdError
from dimd.mpi import (FORWARD_GRACE_S, AgreedError, LaunchMismatch, ThreadLevel, abort, agree_or_raise,
                      init_mpi, leaves_quietly)
from dimd.options import DEFERS_OUTPUT_CHECKS, cli_message, command_flags, output_problems
from dimd.wording import flags_named

#: Ranks other than 0 wait this long before reporting, so that an error every
#: rank hits alike is printed once, by rank 0, whose abort ends them.
_NONZERO_RANK_GRACE_S = 1.0
#: After an error every rank agreed on, the ranks wait this long for each other before they exit in
#: order; should one not come (it took another path), the job is aborted instead.
AGREED_EXIT_S = 30.0


def mpi_command(thread_level: ThreadLevel = "single", *,
                install_handlers: Callable[[], object] | None = None,
                ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Start MPI at ``thread_level`` and run the command under it.

    ``install_handlers`` (e.g. the training's stop signals) runs just before MPI
    starts and again right after, so no signal falls between MPI_Init's own
    handlers and the command's.
    """
    def decorate(callback: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(callback)
        def run(*args: Any, **kwargs: Any) -> Any:
            if install_handlers is not None:
                install_handlers()
            setup = start_mpi(thread_level)
            if install_handlers is not None:
                install_handlers()
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            leaving = comm.Dup()   # MPI: only the exit after an agreed error meets here
            try:
                agree_or_raise(comm, output_problems() if comm.Get_rank() == 0 else None)
                with flags_named(command_flags()):   # the lines the library prints from its threads name flags
                    return callback(*args, comm=comm, mpi_setup=setup, **kwargs)
            except (click.exceptions.Exit, click.Abort):
                raise
            except SystemExit as exc:
                if exc.code in (0, None):
                    raise
                abort_job(comm, f"exit status {exc.code}", 1)
            except click.UsageError as exc:   # an option's value its config refused: every rank parsed the same line
                leave_together(comm, leaving, exc.format_message(), 2)
            except AgreedError as exc:
                leave_together(comm, leaving, cli_message(str(exc)), 1)
            except DimdError as exc:
                abort_job(comm, cli_message(str(exc)), 1)
            except KeyboardInterrupt as exc:
                from dimd.signals import interrupt_exit

                message, code = interrupt_exit(exc)
                abort_job(comm, message, code, prefix="dimd: ")   # not an error: `dimd: rank 0: interrupted`
            except BaseException:  # a bug: show where, then end every rank
                abort_job(comm, traceback.format_exc().rstrip(), 1)
            finally:   # reached by every rank alike (an abort never returns): the command's end, or the ordered exit
                leaving.Free()

        setattr(run, DEFERS_OUTPUT_CHECKS, True)
        return run

    return decorate


def check_outputs(comm: Any, *locations: tuple[str, Any, str]) -> None:
    """Collective: rank 0 checks each ``(flag, path, kind)`` (kind "file" or "folder"), all ranks agree.

    For output locations that are not options of type
    :class:`dimd.options.OutputPath` (those :func:`mpi_command` checks by itself).
    A folder may be missing (it is created); a file's folder must exist.
    """
    from dimd.fsutil import output_problem

    problem = None
    if comm.Get_rank() == 0:
        for flag, path, kind in locations:
            if path is not None:
                problem = output_problem(path, kind=kind, create=kind == "folder", what=flag)  # type: ignore[arg-type]
                if problem:
                    break
    agree_or_raise(comm, problem)


def start_mpi(thread_level: ThreadLevel):
    """:func:`init_mpi`, or exit 1 with one line when the launch made N singletons."""
    try:
        return init_mpi(thread_level)
    except LaunchMismatch as exc:
        if leaves_quietly(exc.first_task):
            sys.exit(0)
        write_line(sys.stderr, f"dimd: error: {exc}")
        sys.exit(1)


def refuse_with_the_job(message: str, code: int = 2) -> None:
    """A usage error this rank met before MPI started, while the launcher started several ranks.

    The others may not have met it (mpiexec's ``A : B`` gives ranks different
    command lines), and an MPI command on them waits in ``MPI_Init`` for this
    rank for ever. So this rank starts MPI as :func:`mpi_command` does and
    meets them at their first collective, which every MPI command begins with
    (:func:`dimd.mpi.agree_or_raise` on the output locations): every rank
    learns the first rank's problem, rank 0 says it, and the job ends in order
    (this rank with ``code``, the others with 1). Returns only where the launch
    gave each process a world of its own: no rank waits for another then.
    """
    try:
        init_mpi("single")
    except LaunchMismatch:
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    leaving = comm.Dup()   # MPI: as mpi_command's, collective with it
    try:
        agree_or_raise(comm, message)
    except AgreedError as exc:
        leave_together(comm, leaving, str(exc), code)


def leave_together(comm: Any, leaving: Any, message: str, code: int) -> None:
    """Every rank met the same error at the same point: rank 0 says it once, every rank exits ``code``.

    The ranks finalise MPI as at a normal end, so the launcher prints no abort
    notice and cleans up after itself (MPICH's hydra leaves a
    ``/tmp/hydra_hwloc_xmlfile_*`` behind every ``MPI_Abort``), and nobody
    waits out a grace period. First they meet in a barrier on ``leaving``, a
    communicator nothing else uses: a rank that does not arrive within
    :data:`AGREED_EXIT_S` (it took another path and may be waiting in a
    collective) gets the job aborted as for one rank's error, so the exit in
    order cannot hang it.
    """
    rank = comm.Get_rank()
    if rank == 0:   # before the barrier: a launcher may end the job at the first rank's non-zero exit (Open MPI's)
        write_line(sys.stderr, "dimd: error: " + message)
    sys.stdout.flush()
    everyone = leaving.Ibarrier()
    deadline = time.monotonic() + AGREED_EXIT_S
    while not everyone.Test():
        if time.monotonic() > deadline:   # a rank took another path: end the job as for one rank's error
            abort_job(comm, message, code, said=rank == 0)
        time.sleep(0.005)
    sys.exit(code)


def abort_job(comm: Any, message: str, code: int, *, said: bool = False, prefix: str = "dimd: error: ") -> None:
    """Print ``message`` once (unless this rank ``said`` it already) and end every rank of ``comm``'s job."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        time.sleep(_NONZERO_RANK_GRACE_S)
    prefix = prefix if size == 1 else f"{prefix}rank {rank}: "
    if not said:
        write_line(sys.stderr, prefix + message)   # one write: under -u, print's two may be split by stdout
    sys.stdout.flush()
    if size == 1:
        sys.exit(code)
    time.sleep(FORWARD_GRACE_S)
    abort(comm, code)
