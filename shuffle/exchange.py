"""The byte exchange behind a shuffle: one Alltoall of counts, Alltoallv of index rows and of bytes.

Counts and displacements come from ``np.cumsum``; buffers are numpy arrays
passed to mpi4py's upper-case methods. mpi4py >= 4 calls MPI-4's large-count
collectives (``MPI_Alltoallv_c``; emulated with derived datatypes on older
MPI libraries), so shares and messages above 2 GiB need no chunking here.
"""

from __future__ import annotations

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


def gather_bytes(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Copy the byte ranges ``[starts[i], starts[i] + lengths[i])`` of ``data`` back to back.

    Ranges that already follow each other in ``data`` are merged first, so a
    buffer still in load order is copied in one piece; otherwise one memcpy
    per record (records are tens of KiB, so the copy, not Python, dominates).
    """
    lengths = lengths.astype(np.int64, copy=False)
    starts = starts.astype(np.int64, copy=False)
    out = np.empty(int(lengths.sum()), np.uint8)
    if len(lengths) == 0:
        return out
    breaks = np.flatnonzero(starts[1:] != starts[:-1] + lengths[:-1]) + 1
    run_first = np.concatenate(([0], breaks))
    run_starts = starts[run_first]
    run_lengths = block_sums(lengths, np.diff(np.concatenate((run_first, [len(lengths)]))))
    run_out = displacements(run_lengths)
    source, target = data.data, out.data   # the arrays' own buffers: slicing copies nothing
    for begin, length, at in zip(run_starts.tolist(), run_lengths.tolist(), run_out.tolist()):
        target[at : at + length] = source[begin : begin + length]
    return out


@dataclass
class Received:
    """What arrived: the bytes, one index row per record and where each record starts."""

    data: np.ndarray
    meta: np.ndarray
    starts: np.ndarray
    records_from_others: int
    bytes_from_others: int


def alltoallv_records(comm: Any, sendbuf: np.ndarray, send_meta: np.ndarray, send_counts: np.ndarray,
                      allocate: Callable[[int], np.ndarray] | None = None) -> Received:
    """Send ``send_counts[d]`` consecutive records (rows and bytes) to rank ``d`` of ``comm``.

    ``sendbuf`` holds the records' bytes in the order of ``send_meta``, grouped
    by destination. Returns the received records grouped by source rank, their
    bytes received straight into ``allocate(nbytes)`` (default: a new array).
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    send_counts = np.ascontiguousarray(send_counts, np.int64)
    recv_counts = np.empty_like(send_counts)
    comm.Alltoall(send_counts, recv_counts)

    row = META_DTYPE.itemsize
    recv_meta = np.empty(int(recv_counts.sum()), META_DTYPE)
    comm.Alltoallv([send_meta.view(np.uint8), (send_counts * row, displacements(send_counts) * row), MPI.BYTE],
                   [recv_meta.view(np.uint8), (recv_counts * row, displacements(recv_counts) * row), MPI.BYTE])

    send_bytes = block_sums(send_meta["length"], send_counts)
    recv_lengths = recv_meta["length"].astype(np.int64)
    recv_bytes = block_sums(recv_lengths, recv_counts)
    total = int(recv_bytes.sum())
    recvbuf = allocate(total) if allocate is not None else np.empty(total, np.uint8)
    comm.Alltoallv([sendbuf, (send_bytes, displacements(send_bytes)), MPI.BYTE],
                   [recvbuf, (recv_bytes, displacements(recv_bytes)), MPI.BYTE])
    return Received(data=recvbuf, meta=recv_meta, starts=displacements(recv_lengths),
                    records_from_others=int(recv_counts.sum() - recv_counts[rank]),
                    bytes_from_others=int(recv_bytes.sum() - recv_bytes[rank]))
