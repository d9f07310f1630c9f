"""The worker pool of ``dimd pack`` and ``dimd verify``: forked processes, and a teardown that cannot hang.

``multiprocessing.Pool.terminate()`` kills the workers and then joins the
pool's task thread. When a worker is killed while it holds the result queue's
lock (between two results), that thread waits on the lock forever, and so does
``terminate()`` (python/cpython#96995, open; seen here once, on Ctrl-C during a
pack on a loaded machine). Here the teardown runs in a thread of its own: past
:data:`TEARDOWN_S` the workers are killed and the stuck thread, a daemon, is
left to end with the process, so the caller goes on to remove its partial
outputs.

A worker killed while it works (SIGKILL, the out-of-memory killer) is replaced
by the pool, but the tasks it held are lost and ``imap`` would wait for their
results forever: :func:`imap_watched` raises instead.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import threading
from multiprocessing.pool import Pool
from typing import Any, Callable, Iterable, Iterator

from dimd.errors import DimdError
from dimd.host import available_cores
from dimd.private_apis import pool_workers

#: How long a pool's teardown may take before its workers are killed.
TEARDOWN_S = 5.0
#: Worker processes per available core at most: the work is CPU-bound, so more would only cost memory
#: and start-up time (``--workers 100000`` forked that many).
MAX_WORKERS_PER_CORE = 4
#: How often a wait for a result checks that the pool's workers still run.
WATCH_S = 0.5


def pool_size(requested: int | None, tasks: int | None) -> int:
    """The workers for ``tasks`` tasks: ``requested`` (default: the available cores), at most
    :data:`MAX_WORKERS_PER_CORE` per available core and one per task. ``tasks`` is None when the
    count is known only once the source has been read (an archive streamed front to back)."""
    cores = available_cores()
    workers = min(requested or cores, MAX_WORKERS_PER_CORE * cores)
    return max(1, workers if tasks is None else min(workers, tasks))


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
    workers = pool_workers(pool)
    ender = threading.Thread(target=pool.terminate, name="dimd-pool-teardown", daemon=True)
    ender.start()
    ender.join(deadline_s)
    if not ender.is_alive():
        return
    for worker in workers:
        if worker.exitcode is None:
            worker.kill()
        worker.join(1.0)


def imap_watched(pool: Pool, func: Callable[[Any], Any], items: Iterable[Any], chunksize: int = 1, *,
                 doing: str = "working", poll_s: float = WATCH_S, window: int | None = None,
                 chunk_bytes: int | None = None, size_of: Callable[[Any], int] | None = None) -> Iterator[Any]:
    """``pool.imap(func, items, chunksize)``, except that a worker that dies raises :class:`DimdError`.

    ``doing`` ends the message ("packing data/train"). Workers never exit on
    their own before the pool is torn down, so any exit of one means lost tasks.

    ``window`` bounds the chunks in flight (sent and not yet returned): the
    pool's feeder thread would otherwise read a whole source ahead. A chunk
    ends at ``chunksize`` items or, with ``size_of``, once its items reach
    ``chunk_bytes``, so tasks that carry bytes (an archive's members) hold at
    most ``window`` chunks of about ``chunk_bytes`` in memory.
    """
    workers = pool_workers(pool)
    chunks = _chunks(items, chunksize, chunk_bytes, size_of)
    throttle = _Throttle(window) if window else None
    if throttle is not None:
        chunks = throttle.feed(chunks)
    # Chunks made here, as imap makes them, so that its result iterator (which can wait with a
    # timeout) is the one that comes back, not the generator imap wraps it in for chunksize > 1.
    results = pool.imap(_run_chunk, ((func, chunk) for chunk in chunks))
    try:
        while True:
            try:
                chunk = results.next(timeout=poll_s)
            except StopIteration:
                return
            except multiprocessing.TimeoutError:
                for worker in workers:
                    code = worker.exitcode
                    if code is not None:
                        how = (f"was killed by {_signal_name(-code)}" if code < 0
                               else f"exited with status {code}")
                        raise DimdError(f"worker process {worker.pid} {how} while {doing} (out of memory?); "
                                        "its work is lost, so the run stops") from None
                continue
            if throttle is not None:
                throttle.release()
            yield from chunk
    finally:
        if throttle is not None:
            throttle.close()


def _run_chunk(task: tuple[Callable[[Any], Any], tuple[Any, ...]]) -> list[Any]:
    func, chunk = task
    return [func(item) for item in chunk]


def _chunks(items: Iterable[Any], size: int, max_bytes: int | None = None,
            size_of: Callable[[Any], int] | None = None) -> Iterator[tuple[Any, ...]]:
    iterator = iter(items)
    if size_of is None or max_bytes is None:
        while chunk := tuple(itertools.islice(iterator, size)):
            yield chunk
        return
    pending: list[Any] = []
    total = 0
    for item in iterator:
        pending.append(item)
        total += size_of(item)
        if len(pending) == size or total >= max_bytes:
            yield tuple(pending)
            pending, total = [], 0
    if pending:
        yield tuple(pending)


class _Throttle:
    """A semaphore around an iterable consumed by another thread; ``close`` unblocks it for good."""

    def __init__(self, limit: int) -> None:
        self._slots = threading.Semaphore(limit)
        self._closed = False

    def feed(self, items: Iterable[Any]) -> Iterator[Any]:
        for item in items:
            self._slots.acquire()
            if self._closed:
                return
            yield item

    def release(self) -> None:
        self._slots.release()

    def close(self) -> None:
        self._closed = True
        self._slots.release()  # one slot wakes the single feeder thread, which then stops


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
