"""What every algorithm shares: block bounds, reusable scratch, a private communicator.

Fresh multi-MiB temporaries per call cost more than the arithmetic
(docs/mpi.md#mpi-on-one-machine), so scratch memory is one arena per process, grown to
the largest request and reused. Point-to-point algorithms talk on a duplicate
of the caller's communicator (cached on it as an MPI attribute), so their
messages can never match a receive the application posted itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dimd.shares import balanced_bounds

_arena = np.empty(0, dtype=np.uint8)


def scratch(count: int, dtype: np.dtype, *, offset: int = 0) -> np.ndarray:
    """A reusable 1-D array of ``count`` elements of ``dtype``, ``offset`` elements in.

    Views returned by one algorithm call stay valid until the next call that
    asks for more memory; algorithms take every view they need up front.
    """
    global _arena
    itemsize = np.dtype(dtype).itemsize
    end = (offset + count) * itemsize
    if _arena.nbytes < end:
        # Grow geometrically so a sweep over sizes allocates a handful of times.
        _arena = np.empty(max(end, int(_arena.nbytes * 1.5)), dtype=np.uint8)
    return _arena[offset * itemsize:end].view(dtype)


def release_scratch() -> None:
    """Give the scratch arena back (e.g. after a benchmark of large sizes)."""
    global _arena
    _arena = np.empty(0, dtype=np.uint8)


def block_bounds(count: int, parts: int) -> list[int]:
    """:func:`dimd.shares.balanced_bounds` as plain ints: slicing with them is cheaper than with
    numpy scalars, which matters for small messages."""
    return balanced_bounds(count, parts).tolist()


def segment_bounds(count: int, segment: int) -> list[int]:
    """Offsets that cut ``count`` elements into segments of at most ``segment``."""
    if count == 0:
        return [0]
    return np.append(np.arange(0, count, segment, dtype=np.int64), count).tolist()


def auto_segment_bytes(nbytes: int, pieces: int, low: int = 64 << 10, high: int = 8 << 20) -> int:
    """About ``nbytes / pieces``, kept within [low, high]: enough segments to
    pipeline, few enough that per-segment Python and MPI costs stay small."""
    return int(min(high, max(low, nbytes // pieces)))


_keyval: Any = None


def private_comm(comm: Any) -> Any:
    """A duplicate of ``comm`` reserved for dimd's point-to-point algorithms.

    Created once per communicator (a collective call, so on the first
    allreduce every rank makes) and cached on it with ``MPI_Comm_set_attr``;
    MPI frees it with ``comm``.
    """
    global _keyval
    from mpi4py import MPI

    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=lambda _comm, _key, dup: dup.Free())
    dup = comm.Get_attr(_keyval)
    if dup is None:
        dup = comm.Dup()
        comm.Set_attr(_keyval, dup)
    return dup
