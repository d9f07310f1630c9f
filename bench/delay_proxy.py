#!/usr/bin/env python3
"""Relay one TCP connection between stdin/stdout and HOST:PORT, delaying every chunk by DELAY seconds.

bench/netfs.sh gives it to ssh as its ``ProxyCommand``, so the sshfs mount
behind it has a round trip of 2 x DELAY more than the loopback's: each
direction holds each chunk until DELAY after it arrived, in order and
pipelined (a later chunk does not wait for an earlier one's delay to pass),
so the delay costs latency, not bandwidth; ``tc ... netem delay`` does the
same in the kernel where it has netem. Standard library only (ssh runs it
with the system's python3); timed with ``time.sleep``, precise to tens of
microseconds, where an event loop's timers round to a millisecond.

    ssh -o ProxyCommand="python3 bench/delay_proxy.py 127.0.0.1 %p 0.001" ...
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time

CHUNK = 1 << 16


def relay(read, write, close_write, delay: float) -> None:
    """Move chunks from ``read`` to ``write``, each sent ``delay`` s after it was read."""
    held: queue.Queue = queue.Queue()

    def sender() -> None:
        while True:
            due, data = held.get()
            if data is None:
                close_write()
                return
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            write(data)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    while True:
        try:
            data = read(CHUNK)
        except OSError:
            data = b""
        held.put((time.perf_counter() + delay, data or None))
        if not data:
            break
    thread.join()


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__.splitlines()[0] + "\nusage: delay_proxy.py HOST PORT DELAY_SECONDS", file=sys.stderr)
        return 2
    host, port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def write_stdout(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]

    def close_socket_write() -> None:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    up = threading.Thread(target=relay, args=(lambda n: os.read(0, n), sock.sendall, close_socket_write, delay),
                          daemon=True)
    up.start()
    relay(sock.recv, write_stdout, lambda: os.close(1), delay)   # down: ends when sshd closes
    return 0


if __name__ == "__main__":
    sys.exit(main())
