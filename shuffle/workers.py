"""Decoding worker processes: fresh interpreters that decode chunks of batches into shared memory.

Each worker is ``python -m dimd.shuffle.decode_worker FD``, started with
``subprocess`` (fork-exec: a new interpreter with no MPI state, no torch, no
copy of the rank's memory; the "spawn" start method done directly) and one
Unix socket to its rank. Over the socket come the shared segments' file
descriptors (the store's records, the loader's ring of batch slots) and the
tasks: decode batch ``step``'s images ``lo:hi`` into a slot. Back comes
``done`` or ``error`` with one line naming the data file and record. A
worker ends on ``exit`` or when its socket closes.

Workers never initialise MPI (the Python they run imports neither mpi4py
nor torch) and ignore SIGINT, SIGTERM and SIGUSR1: a stop request is the
rank's to act on (checkpoint, then stop); a worker ends when its socket
closes, which is also what happens when the rank dies, however it dies.
"""

from __future__ import annotations

import array
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from dimd.errors import DimdError
from dimd.shuffle.shm import Segment
from dimd.shuffle.streams import CROPS, stream

#: Largest control message (a task carries a chunk's offsets, lengths and record numbers). Each
#: end receives into one buffer of this size, allocated once: a fresh 1 MiB per message cost ~25 us.
MESSAGE_BYTES = 1 << 20
#: Environment variables of the launcher's process-management interface: a worker is not an MPI process.
MPI_ENVIRONMENT = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_", "I_MPI_", "SLURM_STEP_", "MPICH_")
#: glibc's allocator in a worker: every allocation from the heap, and the heap never trimmed. By default
#: an allocation over 128 KiB (a resize's output and its intermediate image, a crop's array) is a fresh
#: mapping, faulted in page by page and unmapped when freed; the threshold adapts upwards only after
#: some frees, and in one of two workers it never settled: 98,000 page faults per epoch, 1.8x the CPU
#: per image of its sibling (docs/shuffle.md, "Page faults in the workers"). Ignored by other C libraries.
WORKER_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
#: The signals that ask a run to stop: the rank handles them (a checkpoint, then the end) and its
#: workers ignore them, ending when the rank closes their sockets.
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}


class WorkerDied(DimdError):
    """A decoding worker ended without being asked to (killed, out of memory)."""


@dataclass(frozen=True)
class DecodeTask:
    """Decode images ``lo:hi`` of a batch of ``count`` into ``ring``'s slot at byte ``slot_offset``.

    ``offsets``/``lengths`` locate each of the batch's ``lo:hi`` records in
    segment ``source`` and ``crcs`` are their index's crc32, checked before
    each decode (or ``paths`` names their files, ``cold`` dropping their
    cached pages first); ``records`` are their numbers, for error messages.
    These are int64 arrays as raw bytes (:func:`int64_bytes`): pickled, a
    numpy array costs four times as much, paid by the rank for every task.
    ``draw_key`` is the batch's (seed, rank, epoch, step): the crops of the
    whole batch are drawn from it, so an image does not depend on the chunking.
    """

    ring: int
    slot_offset: int
    count: int
    lo: int
    hi: int
    image_size: int
    train: bool
    scale: tuple[float, float]
    crop_ratio: float
    draw_key: tuple[int, ...] | None
    source: int | None
    offsets: bytes | None
    lengths: bytes | None
    crcs: bytes | None
    paths: list[str] | None
    cold: bool
    records: bytes
    data_path: str


def int64_bytes(values: np.ndarray) -> bytes:
    """``values`` as the raw int64 bytes a :class:`DecodeTask` carries (``np.frombuffer(b, np.int64)`` reads
    them)."""
    return np.ascontiguousarray(values, np.int64).tobytes()


# ---------------------------------------------------------------------------- the worker process
def decode_task(task: DecodeTask, segments: dict[int, Segment]) -> None:
    """Decode ``task``'s images into its slot; raises :class:`DecodeError` naming the record."""
    from dimd.shuffle.crop import draw_crops
    from dimd.shuffle.decode import DecodeError, crop_hwc, eval_hwc, to_chw

    size = task.image_size
    ring = segments[task.ring].array
    out = ring[task.slot_offset : task.slot_offset + task.count * 3 * size * size].reshape(task.count, 3, size, size)
    draws = draw_crops(stream(CROPS, *task.draw_key), task.count) if task.draw_key else None
    data = segments[task.source].array if task.source is not None else None
    offsets, lengths, crcs = (np.frombuffer(b, np.int64) if b is not None else None
                              for b in (task.offsets, task.lengths, task.crcs))
    for k, j in enumerate(range(task.lo, task.hi)):
        try:
            record = _record(task, data, offsets, lengths, k)
            if crcs is not None and zlib.crc32(record) != crcs[k]:   # about 1% of a decode's time
                raise DecodeError(f"crc32 {zlib.crc32(record):08x}, the index says {int(crcs[k]):08x} (the "
                                  f"bytes changed since the pack: `dimd verify` checks the whole set)")
            if draws is not None:
                tries, position, flip = draws.row(j)
                to_chw(crop_hwc(record, size, tries, position, task.scale), flip, out=out[j])
            else:
                to_chw(eval_hwc(record, size, task.crop_ratio), out=out[j])
        except (DecodeError, OSError) as exc:
            number = int(np.frombuffer(task.records, np.int64)[k])
            where = task.paths[k] if task.paths is not None else f"{task.data_path}: record {number}"
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc   # not the path again
            raise DecodeError(f"{where}: {why}") from None


def _record(task: DecodeTask, data: np.ndarray | None, offsets: np.ndarray | None, lengths: np.ndarray | None,
            k: int) -> bytes | memoryview:
    """The encoded bytes of the task's ``k``-th record: a view of the store's segment, or its file."""
    if task.paths is not None:
        return _read_file(task.paths[k], task.cold)
    assert data is not None and offsets is not None and lengths is not None
    start = int(offsets[k])
    return data.data[start : start + int(lengths[k])]


def _read_file(path: str, cold: bool) -> bytes:
    with open(path, "rb") as f:
        if cold:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return f.read()


def serve(sock: socket.socket) -> None:
    """The worker's loop: attach/detach segments, decode tasks, until the socket closes."""
    segments: dict[int, Segment] = {}
    inbox = bytearray(MESSAGE_BYTES)
    while True:
        size, fds = receive_with_fds(sock, inbox)
        if not size:
            return
        kind, ticket, payload = pickle.loads(memoryview(inbox)[:size])
        if kind == "exit":
            return
        if kind == "attach":
            key, size = payload
            segments[key] = Segment.attach(fds[0], size, key)
        elif kind == "detach":
            segment = segments.pop(payload, None)
            if segment is not None:
                segment.close()
        elif kind == "decode":
            try:
                decode_task(payload, segments)
                reply: tuple = ("done", ticket, None)
            except DimdError as exc:
                reply = ("error", ticket, str(exc))
            except Exception as exc:   # a bug, not bad data: still one line, and the rank decides
                reply = ("error", ticket, f"decoding worker failed: {type(exc).__name__}: {exc}")
            sock.send(pickle.dumps(reply))


def receive_with_fds(sock: socket.socket, inbox: bytearray) -> tuple[int, list[int]]:
    """One message into ``inbox``: its size (0 when the socket closed) and the descriptors it carried."""
    space = socket.CMSG_SPACE(2 * array.array("i").itemsize)
    size, ancillary, _, _ = sock.recvmsg_into([inbox], space)
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return size, list(fds)


def worker_main(argv: list[str]) -> None:
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)   # the rank handles stop requests; we end when it closes
    # Started with these blocked (see DecodeWorkers): one sent to the whole job while this
    # interpreter was starting (SLURM's scancel, LSF's bkill) was held, and is now discarded.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    sock = socket.socket(fileno=int(argv[0]))
    import dimd.shuffle.decode  # noqa: F401  (Pillow and the decoder load before "ready": start-up counts them)

    try:
        sock.send(pickle.dumps(("ready", 0, None)))
        serve(sock)
    except (ConnectionError, EOFError):   # the rank closed its end (it ended, even as we started): so do we
        pass


# ---------------------------------------------------------------------------- the rank's side
def _spawn_shielded(command: list[str], **popen: Any) -> subprocess.Popen:
    """Start a worker with the stop signals blocked, so that it never dies of one before it ignores them.

    A blocked mask survives fork and exec: a TERM sent to every process of the job while the worker's
    interpreter starts (a plain ``scancel``) stays pending in it until it has set SIG_IGN. In the
    rank the same TERM is only held for the moment of the fork, then handled as usual.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return subprocess.Popen(command, **popen)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class DecodeWorkers:
    """``count`` worker processes and their sockets, shared by the loaders of one process.

    :meth:`shared` hands out one pool per worker count (the training and the
    evaluation loader use the same workers); :meth:`release` ends it with its
    last user. Tasks get tickets; :meth:`wait` reads a worker's replies until
    the ticket's arrives, keeping the others' for later. One lock serialises
    the sockets: a GPU's feeding thread runs the training loader while the
    rank's own thread may evaluate with the same workers.
    """

    _pools: dict[int, "DecodeWorkers"] = {}
    #: Re-entrant: a loader dropped without close() is closed by the garbage collector, which may run in
    #: this very thread while it holds the lock to start a pool (a Popen allocating), and release() takes it.
    _pools_lock = threading.RLock()

    def __init__(self, count: int) -> None:
        if count < 1:
            raise DimdError(f"decoding workers must be at least 1 (got {count})")
        started = time.perf_counter()
        self._lock = threading.RLock()
        self._death: str | None = None   # why the pool ended, once a worker died
        self.count = count
        self.users = 0
        self._sockets: list[socket.socket] = []
        self._processes: list[subprocess.Popen] = []
        self._replies: dict[int, tuple[str, str | None]] = {}
        self._in_flight: list[set[int]] = []   # per worker: tickets sent, not yet answered
        self._attached: dict[int, int] = {}   # segment key -> loaders using it
        self._tickets = 0
        self._inbox = bytearray(MESSAGE_BYTES)
        env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENVIRONMENT)}
        env["OMP_NUM_THREADS"] = "1"
        env.update(WORKER_MALLOC)
        try:
            for _ in range(count):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                with theirs:
                    command = [sys.executable, "-m", "dimd.shuffle.decode_worker", str(theirs.fileno())]
                    process = _spawn_shielded(command, pass_fds=(theirs.fileno(),), env=env,
                                              stdin=subprocess.DEVNULL)
                self._sockets.append(ours)
                self._processes.append(process)
                self._in_flight.append(set())
            for w in range(count):
                self._receive(w)   # "ready": the interpreter is up and has imported the decoder
        except BaseException:
            self.close()
            raise
        #: Seconds from the first start to the last worker ready.
        self.startup_seconds = time.perf_counter() - started

    @classmethod
    def shared(cls, count: int) -> "DecodeWorkers":
        with cls._pools_lock:
            pool = cls._pools.get(count)
            if pool is None or pool.closed:
                pool = cls._pools[count] = cls(count)
            pool.users += 1
            return pool

    def release(self) -> None:
        """One user fewer; the last one ends the workers."""
        with DecodeWorkers._pools_lock:
            self.users -= 1
            if self.users <= 0:
                self.close()
                if DecodeWorkers._pools.get(self.count) is self:
                    del DecodeWorkers._pools[self.count]

    @property
    def closed(self) -> bool:
        return not self._sockets

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    # -- segments and tasks ---------------------------------------------------------------

    def attach(self, segment: Segment) -> None:
        """Map ``segment`` in every worker (once, however many loaders use it)."""
        with self._lock:
            users = self._attached.get(segment.key, 0)
            if users == 0:
                message = pickle.dumps(("attach", 0, (segment.key, segment.size)))
                for w in range(self.count):
                    self._send(w, message, [segment.fd])
            self._attached[segment.key] = users + 1

    def detach(self, key: int) -> None:
        """One loader fewer uses segment ``key``; the last one unmaps it in the workers (after earlier tasks)."""
        with self._lock:
            users = self._attached.get(key, 0) - 1
            if users > 0:
                self._attached[key] = users
                return
            self._attached.pop(key, None)
            message = pickle.dumps(("detach", 0, key))
            for w in range(self.count):
                self._send(w, message)

    def submit(self, worker: int, task: DecodeTask) -> int:
        with self._lock:
            self._tickets += 1
            self._send(worker, pickle.dumps(("decode", self._tickets, task)))
            self._in_flight[worker].add(self._tickets)
            return self._tickets

    def finish_tasks(self) -> None:
        """Until every worker has answered every task sent so far (the answers are kept for :meth:`wait`)."""
        with self._lock:
            for worker, tickets in enumerate(self._in_flight):
                while tickets:
                    self._receive(worker)

    def wait(self, worker: int, ticket: int) -> None:
        """Until ``ticket`` is done; a decode error raises it as :class:`DecodeError`."""
        with self._lock:
            from dimd.shuffle.decode import DecodeError

            while ticket not in self._replies:
                self._receive(worker)
            kind, text = self._replies.pop(ticket)
            if kind == "error":
                raise DecodeError(text or "decode failed")

    def discard(self, worker: int, ticket: int) -> None:
        """Wait for a task whose result is no longer wanted (an abandoned batch), ignoring its outcome."""
        with self._lock:
            while ticket not in self._replies:
                self._receive(worker)
            del self._replies[ticket]

    # -- the sockets ----------------------------------------------------------------------

    def _send(self, worker: int, message: bytes, fds: list[int] | None = None) -> None:
        self._check_alive()
        try:
            if fds:
                socket.send_fds(self._sockets[worker], [message], fds)
            else:
                self._sockets[worker].send(message)
        except OSError:
            self._died(worker)

    def _receive(self, worker: int) -> None:
        self._check_alive()
        try:
            size = self._sockets[worker].recv_into(self._inbox)
        except OSError:
            size = 0
        if not size:
            self._died(worker)
        kind, ticket, text = pickle.loads(memoryview(self._inbox)[:size])
        if kind != "ready":
            self._replies[ticket] = (kind, text)
            self._in_flight[worker].discard(ticket)

    def _died(self, worker: int) -> None:
        process = self._processes[worker]
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.close()
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if code == -signal.SIGKILL:
                how += " (out of memory, or killed)"
        else:
            how = f"exited with status {code}" if code is not None else "closed its socket"
        self._death = f"decoding worker {worker} (pid {process.pid}) {how}; the run cannot continue"
        raise WorkerDied(self._death)

    def _check_alive(self) -> None:
        """A loader in another thread of the rank that uses the pool after a worker died gets the same line."""
        if self._death is not None:
            raise WorkerDied(self._death)

    def close(self) -> list[int]:
        """Tell each worker to end, close the sockets and reap the processes: their exit codes
        (0 for one that ended as asked; -9 for one killed after 10 s).

        The closed socket alone would not do: a process forked from the rank
        after the workers started (a torch DataLoader's worker, say) holds a
        copy of it, and the worker would wait for that one too.
        """
        with self._lock:
            return self._close()

    def _close(self) -> list[int]:
        goodbye = pickle.dumps(("exit", 0, None))
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.send(goodbye)
            sock.close()
        self._sockets, self._in_flight = [], []
        codes = []
        for process in self._processes:
            try:
                codes.append(process.wait(timeout=10))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        self._processes = []
        return codes
