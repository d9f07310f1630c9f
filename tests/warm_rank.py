"""A process that borrows the tests' warm interpreter: ``python -S warm_rank.py PYTHON-ARGS``.

A test's ``dimd`` run, an MPI rank (the launcher starts this in its place) or
a job script's ``dimd`` runs this: a Python without site, torch or dimd (a
few milliseconds). It hands its standard streams, a rank's
``PMI_FD`` socket from the launcher, its environment, folder and arguments to the test
process's warm server (``tests/warm_dimd.py``), which forks a child that
runs ``python PYTHON-ARGS`` as this process would have. Here it forwards the
stop signals to that child and ends as the child ends: the same exit status,
or the same signal. When this stub is killed, the server kills the child.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def receive_line(sock: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise SystemExit("warm_rank: the warm server closed the connection")
        data += chunk
    return json.loads(data)


def main() -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["DIMD_TESTS_WARM"])
    fds = [0, 1, 2]
    if os.environ.get("PMI_FD"):
        fds.append(int(os.environ["PMI_FD"]))
    request = {"args": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}
    socket.send_fds(sock, [(json.dumps(request) + "\n").encode()], fds)
    for fd in fds[3:]:
        os.close(fd)   # the PMI socket is the rank's now: the launcher sees it close when the rank ends
    child = receive_line(sock)["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: os.kill(child, sig))
    code = receive_line(sock)["returncode"]
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
