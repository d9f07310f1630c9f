"""Run a click command under MPI so that an error on any rank ends the whole job.

The wrapped callback receives ``comm`` and ``mpi_setup``. A :class:`DimdError`
becomes a one-line message, any other exception a traceback; then the job is
aborted (``MPI_Abort``), so no rank is left waiting in a collective. A launch
that gave every process a world of its own (plain ``srun`` without a PMI)
stops at once, with one line from the launcher's first process.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from typing import Any, Callable

import click

from dimd.errors import DimdError
from dimd.mpi import LaunchMismatch, ThreadLevel, init_mpi
from dimd.options import cli_message

#: Ranks other than 0 wait this long before reporting, so that an error every
#: rank hits (a bad option) is printed once, by rank 0, whose abort ends them.
_NONZERO_RANK_GRACE_S = 1.0
#: MPI_Abort tears the job down at once; the launcher (Hydra, srun) may not yet
#: have forwarded the line just written, and the user would see no reason.
_FORWARD_GRACE_S = 0.5


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
            try:
                return callback(*args, comm=comm, mpi_setup=setup, **kwargs)
            except (click.exceptions.Exit, click.Abort):
                raise
            except SystemExit as exc:
                if exc.code in (0, None):
                    raise
                abort_job(comm, f"exit status {exc.code}", 1)
            except click.UsageError as exc:
                abort_job(comm, exc.format_message(), 2)
            except DimdError as exc:
                abort_job(comm, cli_message(str(exc)), 1)
            except KeyboardInterrupt:
                abort_job(comm, "interrupted", 130)
            except BaseException:  # a bug: show where, then end every rank
                abort_job(comm, traceback.format_exc().rstrip(), 1)

        return run

    return decorate


def start_mpi(thread_level: ThreadLevel):
    """:func:`init_mpi`, or exit 1 with one line when the launch made N singletons."""
    try:
        return init_mpi(thread_level)
    except LaunchMismatch as exc:
        if not exc.first_task:
            time.sleep(_NONZERO_RANK_GRACE_S)  # the first task says it; let it, then go
        else:
            print(f"dimd: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


def abort_job(comm: Any, message: str, code: int) -> None:
    """Print ``message`` once and end every rank of ``comm``'s job."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        time.sleep(_NONZERO_RANK_GRACE_S)
    prefix = "dimd: error: " if size == 1 else f"dimd: error: rank {rank}: "
    print(prefix + message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    if size == 1:
        sys.exit(code)
    time.sleep(_FORWARD_GRACE_S)
    comm.Abort(code)
