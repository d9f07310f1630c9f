"""Ring algorithms: the bandwidth-optimal ring and the DIMD paper's pipelined ring to a root.

``ring``: P-1 reduce-scatter steps then P-1 allgather steps around the ring,
each rank sending and receiving 1/P of the buffer per step (every rank sends
2(P-1)/P of the buffer in all, the lower bound nccl-tests' busbw assumes).

``ring_root`` (DIMD section 5.1): segments are reduced along the ring to one
root, then broadcast back the opposite way; segments pipeline, so while one
segment travels up the ring the next follows it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dimd.allreduce.buffers import auto_segment_bytes, block_bounds, scratch, segment_bounds

_REDUCE, _BCAST = 11, 12


def ring(buf: np.ndarray, comm: Any) -> None:
    """Reduce-scatter then allgather around the ring ``r -> r+1``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buf.size == 0:
        return
    bounds = block_bounds(buf.size, size)
    largest = bounds[1] - bounds[0]  # the first blocks are the larger
    incoming = scratch(largest, buf.dtype)
    right, left = (rank + 1) % size, (rank - 1) % size

    def block(i: int) -> np.ndarray:
        i %= size
        return buf[bounds[i]:bounds[i + 1]]

    # Reduce-scatter: after step s, block (rank - s - 1) holds s + 2 contributions;
    # after P-1 steps this rank owns the full sum of block (rank + 1).
    for step in range(size - 1):
        send, recv = block(rank - step), block(rank - step - 1)
        landing = incoming[: recv.size]
        comm.Sendrecv(send, right, _REDUCE, landing, left, _REDUCE)
        np.add(recv, landing, out=recv)
    # Allgather: pass the finished blocks on around the same ring.
    for step in range(size - 1):
        comm.Sendrecv(block(rank + 1 - step), right, _BCAST, block(rank - step), left, _BCAST)


def ring_root_segment_bytes(nbytes: int) -> int:
    """How ``ring_root`` sizes its segments by default: a pipeline of up to 16, of at least 256 KiB."""
    return auto_segment_bytes(nbytes, 16, low=256 << 10, high=4 << 20)


def ring_root(buf: np.ndarray, comm: Any, *, segment_bytes: int | None = None) -> None:
    """Chain reduce ``1 -> 2 -> ... -> P-1 -> 0`` then broadcast ``0 -> P-1 -> ... -> 1``, pipelined."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buf.size == 0:
        return
    segment = max(1, (segment_bytes or ring_root_segment_bytes(buf.nbytes)) // buf.itemsize)
    bounds = segment_bounds(buf.size, segment)
    segments = len(bounds) - 1
    position = (rank - 1) % size            # place in the reduce chain; the root is last
    up_from = (rank - 1) % size if position > 0 else None
    up_to = (rank + 1) % size if position < size - 1 else None
    down_from = (rank + 1) % size if position < size - 1 else None
    down_to = (rank - 1) % size if position > 0 else None
    incoming = scratch(min(segment, buf.size), buf.dtype)
    reduce_sends: list[Any] = [MPI.REQUEST_NULL] * segments
    pending: list[Any] = []
    # The broadcast of segment j starts `lag` steps after its reduction, which
    # keeps about a ring's length of segments in flight in each direction.
    lag = min(segments, size)
    for step in range(segments + lag):
        if step < segments:
            part = buf[bounds[step]:bounds[step + 1]]
            if up_from is not None:
                landing = incoming[: part.size]
                comm.Recv(landing, up_from, _REDUCE)
                np.add(part, landing, out=part)
            if up_to is not None:
                reduce_sends[step] = comm.Isend(part, up_to, _REDUCE)
            if down_to is not None and down_from is None:  # the root starts the broadcast
                pending.append(comm.Isend(part, down_to, _BCAST))
        j = step - lag
        if j >= 0 and down_from is not None:
            part = buf[bounds[j]:bounds[j + 1]]
            reduce_sends[j].Wait()  # the partial sum must be gone before the total lands
            comm.Recv(part, down_from, _BCAST)
            if down_to is not None:
                pending.append(comm.Isend(part, down_to, _BCAST))
        if len(pending) > 2 * lag:
            MPI.Request.Waitall(pending)
            pending.clear()
    MPI.Request.Waitall(reduce_sends)
    MPI.Request.Waitall(pending)
