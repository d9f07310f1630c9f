"""The tests' warm interpreter: it imports torch and dimd once, then forks a child per process asked for.

Starting Python and importing torch costs about 3 CPU-seconds per process,
most of the suite's time. ``warm_dimd.py SOCKET`` listens on SOCKET; each
``tests/warm_rank.py`` stub (a ``dimd`` run of a test, an MPI rank, a job
script's ``dimd``) connects and passes its standard streams, a rank's
``PMI_FD`` socket from the launcher, its environment, folder and Python
arguments (``-m MODULE ...`` or ``SCRIPT ...``). A keeper process forked per
stub forks the child that runs them, reports its pid and exit status, and
kills it if the stub goes away (as a rank dies with its launcher). Nothing
here starts MPI or a thread before the fork.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
from typing import Callable, NoReturn

# the commands' heavy imports (torch above all), paid once here
import dimd.cli
import dimd.commands.pack
import dimd.commands.plan_batch
import dimd.commands.train
import dimd.shuffle.loader  # the loader, its store and h5py: what every training rank opens
import dimd.train.engine
import dimd.train.sgd
import dimd.train.sma  # noqa: F401
import mpi4py.run  # noqa: F401  # no MPI yet: only the runner of ``python -m mpi4py``
import pytest  # noqa: F401  # imported by the test files whose MPI cases the ranks run
import torch._dynamo  # noqa: F401  # torch.optim's first optimizer imports it: ~900 modules, 1-2 s per rank

gc.freeze()   # what was imported stays out of the children's collections: their pages stay shared, not copied


def run_python(args: list[str]) -> None:
    """What ``python ARGS`` runs: ``-m MODULE ...`` or ``SCRIPT ...``."""
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def become_rank(request: dict, fds: list[int]) -> None:
    """In the child: the stub's streams (and PMI socket) at their numbers, its environment and folder."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: die with the keeper
    spare = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]   # above every number they go to
    for fd in fds:
        os.close(fd)
    for target, fd in zip(request["fds"], spare):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    open_standard_streams(unbuffered=bool(request["env"].get("PYTHONUNBUFFERED")))


def open_standard_streams(unbuffered: bool) -> None:
    """``sys.stdin/stdout/stderr`` over the new fds 0-2, buffered as a fresh ``python`` would buffer them.

    As CPython's start-up: PYTHONUNBUFFERED writes through to the fd; otherwise a terminal (or stderr)
    is line-buffered and a pipe or file block-buffered. A job's log interleaves lines as it would.
    """
    def stream(fd: int, mode: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "rb":
            return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8")
        line = not unbuffered and (raw.isatty() or fd == 2)
        buffer = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffer, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                line_buffering=line, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = stream(0, "rb")
    sys.stdout = sys.__stdout__ = stream(1, "wb")
    sys.stderr = sys.__stderr__ = stream(2, "wb")


def keep(conn: socket.socket) -> dict:
    """In a keeper: fork the rank, tell the stub its pid, then its exit status; kill it if the stub goes.

    Returns only in the child: its request, with its streams in place.
    """
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        conn.close()
        become_rank(request, fds)
        return request
    try:
        for fd in fds:
            os.close(fd)
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        ended = os.pidfd_open(pid)
        while True:
            ready = select.select([conn, ended], [], [])[0]
            if ended in ready:
                break
            if not conn.recv(1):   # the stub is gone (killed): so is its rank
                os.kill(pid, signal.SIGKILL)
                break
        _, status = os.waitpid(pid, 0)
        conn.sendall((json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    finally:
        os._exit(0)


def serve(path: str) -> dict | None:
    """Accept stubs on ``path`` until standard input closes (the test process ended).

    Returns in a child (its request), so that its program runs at the top of the
    stack and ends as :func:`end_as_python_ends` says.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # keepers are reaped by the kernel
    print(json.dumps({"listening": path}), flush=True)
    while True:
        ready = select.select([sys.stdin, listener], [], [])[0]
        if sys.stdin in ready and not sys.stdin.readline():
            return None
        if listener in ready:
            conn, _ = listener.accept()
            if os.fork() == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                listener.close()
                return keep(conn)
            conn.close()


def end_as_python_ends(program: Callable[[], None], under_mpi4py: bool = False) -> NoReturn:
    """Run ``program``, then end as CPython's exit does, short of freeing every object one by one.

    Kept: the exit status (``SystemExit``'s code; 1 after an uncaught exception,
    shown by ``sys.excepthook``; death by SIGINT after an uncaught Ctrl-C),
    non-daemon threads joined, ``atexit`` callbacks, ``MPI_Finalize`` or the
    ``MPI_Abort`` that ``python -m mpi4py`` (``under_mpi4py``) asked for (what
    mpi4py does at exit, see :func:`abort_requested`), PMI's ``finalize``
    (what MPICH does at exit, see :func:`finalize_pmi`), flushed streams.
    Left out: the C library's exit handlers (libtorch's static destructors,
    most likely: not traced), which write to pages this child still shares
    with the warm interpreter (copy-on-write): about 0.3 s per process, paid
    for nothing.
    """
    code, interrupted = 0, False
    try:
        program()
    except SystemExit as exc:
        code = system_exit_code(exc)
    except BaseException as exc:   # what the interpreter would show, it shows
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    threading._shutdown()   # type: ignore[attr-defined]  # as Py_FinalizeEx: wait for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120   # as CPython: output that could not be written
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        if not mpi.Is_finalized():
            abort = abort_requested(code, under_mpi4py)
            if abort:
                mpi.COMM_WORLD.Abort(abort)
            mpi.Finalize()
        finalize_pmi()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def finalize_pmi() -> None:
    """Tell the launcher (MPICH's Hydra, over ``PMI_FD``) that this rank ends, as MPICH does at exit.

    MPICH sends PMI-1's ``finalize`` from a C exit handler, not from
    ``MPI_Finalize``; this child skips those handlers. A rank whose PMI socket
    closes without it is taken for a crash, and Hydra kills the whole job.
    """
    fd = os.environ.get("PMI_FD")
    if not fd:
        return
    os.write(int(fd), b"cmd=finalize\n")
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = os.read(int(fd), 64)
        if not chunk:
            break
        reply += chunk
    if not reply.startswith(b"cmd=finalize_ack"):
        print(f"warm_dimd: PMI finalize answered {reply!r}", file=sys.stderr)


def system_exit_code(exc: SystemExit) -> int:
    """The status ``raise SystemExit(code)`` ends Python with (a message is printed, then 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def abort_requested(code: int, under_mpi4py: bool) -> int:
    """The status of the ``MPI_Abort`` mpi4py would call at exit (0: none): its C exit handler, skipped here.

    Where dimd started MPI it notes mpi4py's requests, and takes one back for
    an error every rank raised alike (:mod:`dimd.private_apis`); elsewhere
    ``python -m mpi4py`` asks for the exit status, if it is not 0.
    """
    from dimd import private_apis

    if private_apis.watching_abort_requests():
        return private_apis.abort_requested_at_exit()
    return code if under_mpi4py else 0


if __name__ == "__main__":
    child = serve(sys.argv[1])
    if child is not None:
        end_as_python_ends(lambda: run_python(child["args"]), under_mpi4py=child["args"][:2] == ["-m", "mpi4py"])
