"""The byte exchange behind a shuffle: one Alltoall of counts, Alltoallv of index rows and of bytes.

Counts and displacements come from ``np.cumsum``; buffers are numpy arrays
passed to mpi4py's upper-case methods. mpi4py >= 4 calls MPI-4's large-count
collectives (``MPI_Alltoallv_c``; emulated with derived datatypes on older
MPI libraries), so shares and messages above 2 GiB need no chunking here.
"""

from __future__ import annotations

import ctypes
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

#: The index row that travels with each record (24 bytes).
META_DTYPE = np.dtype([
    ("index", "<i8"),    # position of the record in the packed file
    ("label", "<i4"),
    ("length", "<u4"),
    ("crc32", "<u4"),
    ("height", "<u2"),
    ("width", "<u2"),
])


def displacements(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: where each block starts."""
    out = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def block_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive blocks of ``values`` of sizes ``counts`` (exact int64)."""
    edges = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
    bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    return edges[bounds[1:]] - edges[bounds[:-1]]


def _runs(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of the runs of byte ranges that follow each other back to back."""
    lengths = lengths.astype(np.int64, copy=False)
    starts = starts.astype(np.int64, copy=False)
    if len(lengths) == 0:
        return starts, lengths
    breaks = np.flatnonzero(starts[1:] != starts[:-1] + lengths[:-1]) + 1
    first = np.concatenate(([0], breaks))
    return starts[first], block_sums(lengths, np.diff(np.concatenate((first, [len(lengths)]))))


def _compiled_mover() -> Any:
    """The compiled range mover (shuffle/_ranges.c), or None where pip could not build it (no C compiler):
    then one Python call per range moves the same bytes."""
    try:
        return importlib.import_module("dimd.shuffle._ranges")
    except ImportError:
        return None


_ranges = _compiled_mover()


def _move(target: np.ndarray, at: np.ndarray, source: np.ndarray, starts: np.ndarray,
          lengths: np.ndarray) -> None:
    """``target[at[i]:][:lengths[i]] = source[starts[i]:][:lengths[i]]`` for each i in order, memmove-safe.

    One C ``memmove`` per range (overlapping ranges of the same buffer move
    correctly, with no temporary copy), the loop in C with the GIL released
    (:mod:`dimd.shuffle._ranges`) where it was built; the caller has checked the bounds.
    """
    at, starts, lengths = (np.ascontiguousarray(a, np.int64) for a in (at, starts, lengths))
    if _ranges is not None:
        _ranges.move(target, at, source, starts, lengths)
        return
    _move_in_python(target, at, source, starts, lengths)


def _move_in_python(target: np.ndarray, at: np.ndarray, source: np.ndarray, starts: np.ndarray,
                    lengths: np.ndarray) -> None:
    """:func:`_move` without the compiled mover: one ``ctypes.memmove`` call per range."""
    to, frm = target.ctypes.data, source.ctypes.data
    for a, b, n in zip(at.tolist(), starts.tolist(), lengths.tolist()):
        if n and (to + a != frm + b):
            ctypes.memmove(to + a, frm + b, n)


def gather_bytes(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Copy the byte ranges ``[starts[i], starts[i] + lengths[i])`` of ``data`` back to back.

    Ranges that already follow each other in ``data`` are merged first, so a
    buffer still in load order is copied in one piece; otherwise one memcpy
    per record, the loop in C (:func:`_move`).
    Into the front of ``out`` when given (a buffer whose pages are already
    touched costs no page faults: a fresh one cost a shuffle 13-22 ms on the
    development VM, docs/shuffle.md), a new array otherwise; returns the
    filled part.
    """
    run_starts, run_lengths = _runs(starts, lengths)
    total = int(run_lengths.sum())
    if out is None:
        out = np.empty(total, np.uint8)
    elif len(out) < total:
        raise ValueError(f"the output buffer holds {len(out)} bytes, the ranges {total}")
    out = out[:total]
    if len(run_starts) and (run_starts.min() < 0 or (run_starts + run_lengths).max() > len(data)):
        raise ValueError("a byte range lies outside the buffer")
    _move(out, displacements(run_lengths), data, run_starts, run_lengths)
    return out


def pack_down(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Move the byte ranges of ``data`` (given in increasing, disjoint order) to its front, back to back.

    In place: each range moves towards the start, never over one not yet
    moved. Returns each range's new start and where the packed bytes end.
    """
    lengths = lengths.astype(np.int64, copy=False)
    new_starts = displacements(lengths)
    run_starts, run_lengths = _runs(starts, lengths)
    if len(run_starts) and ((run_starts[1:] < run_starts[:-1] + run_lengths[:-1]).any() or run_starts[0] < 0
                            or run_starts[-1] + run_lengths[-1] > len(data)):
        raise ValueError("the byte ranges to pack are not increasing, disjoint and inside the buffer")
    _move(data, displacements(run_lengths), data, run_starts, run_lengths)
    return new_starts, int(lengths.sum())


@dataclass
class Received:
    """What arrived: the bytes, one index row per record and where each record starts."""

    data: np.ndarray
    meta: np.ndarray
    starts: np.ndarray
    records_from_others: int
    bytes_from_others: int


def exchange_rows(comm: Any, send_meta: np.ndarray, send_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Send the index rows of ``send_counts[d]`` consecutive records to rank ``d``: (rows, counts) received.

    One ``Alltoall`` of counts, one ``Alltoallv`` of the rows; what arrives is
    grouped by source rank. The rows say how many bytes will follow.
    """
    from mpi4py import MPI

    send_counts = np.ascontiguousarray(send_counts, np.int64)
    recv_counts = np.empty_like(send_counts)
    comm.Alltoall(send_counts, recv_counts)
    row = META_DTYPE.itemsize
    recv_meta = np.empty(int(recv_counts.sum()), META_DTYPE)
    comm.Alltoallv([send_meta.view(np.uint8), (send_counts * row, displacements(send_counts) * row), MPI.BYTE],
                   [recv_meta.view(np.uint8), (recv_counts * row, displacements(recv_counts) * row), MPI.BYTE])
    return recv_meta, recv_counts


def exchange_bytes(comm: Any, sendbuf: np.ndarray, send_meta: np.ndarray, send_counts: np.ndarray,
                   recv_meta: np.ndarray, recv_counts: np.ndarray, recvbuf: np.ndarray) -> None:
    """The records' bytes after :func:`exchange_rows`: one ``Alltoallv`` into ``recvbuf``, grouped by source."""
    from mpi4py import MPI

    send_bytes = block_sums(send_meta["length"], send_counts)
    recv_bytes = block_sums(recv_meta["length"], recv_counts)
    comm.Alltoallv([sendbuf, (send_bytes, displacements(send_bytes)), MPI.BYTE],
                   [recvbuf, (recv_bytes, displacements(recv_bytes)), MPI.BYTE])


def alltoallv_records(comm: Any, sendbuf: np.ndarray, send_meta: np.ndarray, send_counts: np.ndarray,
                      allocate: Callable[[int], np.ndarray] | None = None) -> Received:
    """Send ``send_counts[d]`` consecutive records (rows and bytes) to rank ``d`` of ``comm``.

    ``sendbuf`` holds the records' bytes in the order of ``send_meta``, grouped
    by destination. Returns the received records grouped by source rank, their
    bytes received straight into ``allocate(nbytes)`` (default: a new array).
    """
    rank = comm.Get_rank()
    recv_meta, recv_counts = exchange_rows(comm, send_meta, send_counts)
    recv_lengths = recv_meta["length"].astype(np.int64)
    recv_bytes = block_sums(recv_lengths, recv_counts)
    total = int(recv_bytes.sum())
    recvbuf = allocate(total) if allocate is not None else np.empty(total, np.uint8)
    exchange_bytes(comm, sendbuf, send_meta, send_counts, recv_meta, recv_counts, recvbuf)
    return Received(data=recvbuf, meta=recv_meta, starts=displacements(recv_lengths),
                    records_from_others=int(recv_counts.sum() - recv_counts[rank]),
                    bytes_from_others=int(recv_bytes.sum() - recv_bytes[rank]))
