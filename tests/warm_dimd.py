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

import ctypes
import fcntl
import gc
import json
import os
import runpy
import select
import signal
import socket
import sys

# the commands' heavy imports (torch above all), paid once here
import dimd.cli
import dimd.commands.pack
import dimd.commands.plan_batch
import dimd.commands.train
import dimd.train.engine  # noqa: F401

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
    stack and the interpreter ends it as it ends any program: uncaught exceptions
    through ``sys.excepthook``, then atexit, mpi4py's finalize or abort, C's exit.
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


if __name__ == "__main__":
    child = serve(sys.argv[1])
    if child is not None:
        run_python(child["args"])
