"""A warm interpreter for the tests' ``dimd`` runs: it imports torch and dimd once, then forks a child per run.

Starting Python and importing torch costs about 3 CPU-seconds per process,
most of the suite's time. :func:`conftest.run_dimd` sends each run here as
one JSON line (argv, environment, folder, output files); the server forks,
the child runs ``dimd ARGS`` as ``python -m dimd`` would (its own process,
MPI world, signal handlers, stdin at /dev/null, standard output and error to
the files, ``atexit`` handlers run at the end), and the server answers with
the child's exit status. Nothing here starts MPI or a thread before the fork.

``warm_dimd.py --ranks SOCKET`` serves MPI ranks the same way: the launcher
starts ``tests/warm_rank.py`` as each rank, which connects to SOCKET and
passes its standard streams, the launcher's ``PMI_FD``, its environment and
its Python arguments (``-m MODULE ...`` or ``SCRIPT ...``). A keeper process
forked per rank forks the rank itself, reports its pid and exit status, and
kills it if the stub goes away (as a rank dies with its launcher).
"""

from __future__ import annotations

import atexit
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
import threading
import traceback

import dimd.cli
# the commands' heavy imports (torch above all), paid once here
import dimd.commands.pack
import dimd.commands.plan_batch
import dimd.commands.train
import dimd.train.engine

gc.freeze()   # what was imported stays out of the children's collections: their pages stay shared, not copied


def run_child(request: dict) -> None:
    """In the forked child: ``dimd ARGS`` with the request's folder, environment and output files."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["dimd", *request["args"]]
    code: object = 0
    try:
        dimd.cli.main(request["args"], prog_name="dimd")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()   # as the interpreter ends: wait for non-daemon threads, then run atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def serve() -> None:
    """One run at a time: a request line in, ``{"pid": ...}`` when started, ``{"returncode": ...}`` when done."""
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


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
    """In the rank: the stub's streams and PMI socket at their numbers, its environment and folder."""
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

    Returns only in the rank: its request, with its streams in place.
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


def serve_ranks(path: str) -> dict | None:
    """Accept ranks on ``path`` until standard input closes (the test process ended).

    Returns in a rank (its request), so that its program runs at the top of the
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
    if sys.argv[1:2] == ["--ranks"]:
        rank = serve_ranks(sys.argv[2])
        if rank is not None:
            del rank["env"]
            run_python(rank["args"])
    else:
        serve()
