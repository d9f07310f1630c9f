"""The worker pool of ``dimd pack`` and ``dimd verify``: forked processes, and a teardown that cannot hang.

``multiprocessing.Pool.terminate()`` kills the workers and then joins the
pool's task thread. When a worker is killed while it holds the result queue's
lock (between two results), that thread waits on the lock forever, and so does
``terminate()`` (python/cpython#96995, open; seen here once, on Ctrl-C during a
pack on a loaded machine). Here the teardown runs in a thread of its own: past
:data:`TEARDOWN_S` the workers are killed and the stuck thread, a daemon, is
left to end with the process, so the caller goes on to remove its partial
outputs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from multiprocessing.pool import Pool
from typing import Any, Callable, Iterator

#: How long a pool's teardown may take before its workers are killed.
TEARDOWN_S = 5.0


@contextlib.contextmanager
def worker_pool(workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> Iterator[Pool]:
    """``with Pool(workers, initializer, initargs) as pool``, forked where the OS can (the parent's imports
    come for free), except that leaving the block takes at most :data:`TEARDOWN_S`."""
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    pool = context.Pool(workers, initializer, initargs)
    try:
        yield pool
    finally:
        terminate_within_deadline(pool)


def terminate_within_deadline(pool: Pool, deadline_s: float = TEARDOWN_S) -> None:
    """``pool.terminate()``; if it has not returned after ``deadline_s``, kill the workers and go on."""
    workers = list(getattr(pool, "_pool", ()))   # the pool's own worker processes, not the caller's others
    ender = threading.Thread(target=pool.terminate, name="dimd-pool-teardown", daemon=True)
    ender.start()
    ender.join(deadline_s)
    if not ender.is_alive():
        return
    for worker in workers:
        if worker.exitcode is None:
            worker.kill()
        worker.join(1.0)
