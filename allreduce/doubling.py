"""Butterfly algorithms over the largest power of two, with the extra ranks folded in.

With P' the largest power of two <= P and r = P - P', the first 2r ranks pair
up (even gives its buffer to odd and waits), so P' ranks run the butterfly
and the odd ones hand the result back at the end: MPICH's and Thakur,
Rabenseifner & Gropp's scheme.

``recursive_doubling``: log2(P') rounds, each exchanging the whole buffer
with the partner ``rank ^ mask``; latency-optimal, for small buffers.

``rabenseifner``: reduce-scatter by recursive halving (each round exchanges
half of what is left) then allgather by recursive doubling; every rank sends
about 2(P'-1)/P' of the buffer, like the ring, in 2 log2(P') rounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dimd.allreduce.buffers import block_bounds, scratch

_FOLD, _EXCHANGE, _GATHER, _UNFOLD = 31, 32, 33, 34


def _fold_in(buf: np.ndarray, comm: Any) -> tuple[int, int]:
    """Pair off the ranks beyond the power of two; return (P', this rank's butterfly
    rank or -1 when it sits out)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    if rank < 2 * extra:
        if rank % 2 == 0:
            comm.Send(buf, rank + 1, _FOLD)
            return pof2, -1
        incoming = scratch(buf.size, buf.dtype)
        comm.Recv(incoming, rank - 1, _FOLD)
        np.add(buf, incoming, out=buf)
        return pof2, rank // 2
    return pof2, rank - extra


def _real_rank(virtual: int, comm: Any) -> int:
    extra = comm.Get_size() - (1 << (comm.Get_size().bit_length() - 1))
    return virtual * 2 + 1 if virtual < extra else virtual + extra


def _fold_out(buf: np.ndarray, comm: Any, virtual: int) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    extra = size - (1 << (size.bit_length() - 1))
    if rank < 2 * extra:
        if virtual < 0:
            comm.Recv(buf, rank + 1, _UNFOLD)
        else:
            comm.Send(buf, rank - 1, _UNFOLD)


def recursive_doubling(buf: np.ndarray, comm: Any) -> None:
    """Exchange and add the whole buffer with partner ``rank ^ mask``, mask = 1, 2, 4..."""
    if comm.Get_size() == 1 or buf.size == 0:
        return
    pof2, virtual = _fold_in(buf, comm)
    if virtual >= 0:
        incoming = scratch(buf.size, buf.dtype)
        mask = 1
        while mask < pof2:
            partner = _real_rank(virtual ^ mask, comm)
            comm.Sendrecv(buf, partner, _EXCHANGE, incoming, partner, _EXCHANGE)
            np.add(buf, incoming, out=buf)
            mask <<= 1
    _fold_out(buf, comm, virtual)


def rabenseifner(buf: np.ndarray, comm: Any) -> None:
    """Recursive-halving reduce-scatter, then recursive-doubling allgather."""
    if comm.Get_size() == 1 or buf.size == 0:
        return
    pof2, virtual = _fold_in(buf, comm)
    if virtual >= 0:
        bounds = block_bounds(buf.size, pof2)
        incoming = scratch(int(bounds[pof2 // 2]), buf.dtype)  # the first half is the larger
        lo, hi = 0, pof2  # the blocks this rank is still responsible for
        mask = pof2 >> 1
        while mask:  # halve: keep the half that holds block `virtual`
            partner = _real_rank(virtual ^ mask, comm)
            mid = lo + (hi - lo) // 2
            if virtual & mask:
                keep, give = (mid, hi), (lo, mid)
            else:
                keep, give = (lo, mid), (mid, hi)
            mine = buf[bounds[keep[0]]:bounds[keep[1]]]
            landing = incoming[: mine.size]
            comm.Sendrecv(buf[bounds[give[0]]:bounds[give[1]]], partner, _EXCHANGE,
                          landing, partner, _EXCHANGE)
            np.add(mine, landing, out=mine)
            lo, hi = keep
            mask >>= 1
        mask = 1
        while mask < pof2:  # double: swap finished ranges with the same partners, in reverse
            partner = _real_rank(virtual ^ mask, comm)
            width = hi - lo
            other = (lo + width, hi + width) if not virtual & mask else (lo - width, hi - width)
            comm.Sendrecv(buf[bounds[lo]:bounds[hi]], partner, _GATHER,
                          buf[bounds[other[0]]:bounds[other[1]]], partner, _GATHER)
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1
    _fold_out(buf, comm, virtual)
