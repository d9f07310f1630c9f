"""FireCaffe's two contenders (section 6): a reduction tree against a parameter server.

``tree``: binomial reduction to rank 0 in log2(P) rounds, then a binomial
broadcast back; the root's links carry log2(P) buffers instead of P-1.

``parameter_server``: rank 0 receives every rank's whole buffer, sums and
sends the sum back to each; its link carries 2(P-1) buffers, which is why
it stops scaling.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dimd.allreduce.buffers import scratch

_REDUCE, _BCAST = 21, 22


def tree(buf: np.ndarray, comm: Any) -> None:
    """Binomial reduce to rank 0, then binomial broadcast from it."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buf.size == 0:
        return
    incoming = scratch(buf.size, buf.dtype)
    mask = 1
    while mask < size:  # reduce: absorb children rank+1, rank+2, rank+4... until a parent
        if rank & mask:
            comm.Send(buf, rank - mask, _REDUCE)
            break
        if rank + mask < size:
            comm.Recv(incoming, rank + mask, _REDUCE)
            np.add(buf, incoming, out=buf)
        mask <<= 1
    # broadcast: the reverse walk; each rank receives from the parent it sent to.
    if rank:
        comm.Recv(buf, rank - mask, _BCAST)
    mask >>= 1
    while mask:
        if rank + mask < size:
            comm.Send(buf, rank + mask, _BCAST)
        mask >>= 1


def parameter_server(buf: np.ndarray, comm: Any) -> None:
    """Rank 0 sums every rank's buffer as it arrives and sends the total back."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buf.size == 0:
        return
    if rank:
        comm.Send(buf, 0, _REDUCE)
        comm.Recv(buf, 0, _BCAST)
        return
    incoming = scratch(buf.size, buf.dtype)
    for _ in range(size - 1):  # in arrival order, as a server would
        comm.Recv(incoming, MPI.ANY_SOURCE, _REDUCE)
        np.add(buf, incoming, out=buf)
    MPI.Request.Waitall([comm.Isend(buf, worker, _BCAST) for worker in range(1, size)])
