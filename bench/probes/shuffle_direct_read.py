#!/usr/bin/env python3
"""A design not built yet, measured: ranks of one node read their arriving records straight from the senders.

    mpiexec -n P python -m mpi4py bench/probes/shuffle_direct_read.py DATA --reps 7 --json out.json

Loads DATA (a packed set) as ``dimd shuffle`` does and moves the bytes of
round 0 of seed 0 three ways, ``--reps`` times each in turn, from the same
starting layout (nothing is changed in the store):

- ``today``: the copies a shuffle makes now. The leaving records are gathered
  into a kept send buffer, the kept ones copied to the front of the target
  (the shuffle packs them down in place: the same bytes), and one
  ``Alltoallv`` lands the arriving ones behind them.
- ``direct``: no send buffer. The kept records are copied into the target,
  and each rank reads its arriving records from the senders' memory with
  ``process_vm_readv`` (one call per 1,024 records, scattered on both sides),
  then a barrier, after which a sender could change its segment again. Every
  byte is copied once. It needs the senders on the same node, and a second
  segment per rank that the two alternate between.
- ``bare``: one ``Alltoallv`` of the same bytes per rank between contiguous
  buffers (``bench/bare_alltoallv.py``'s limit).

``today`` and ``direct`` must leave the same bytes in their targets. Each time
is the slowest rank's, the figures medians over the repetitions after the first.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from typing import Any, Callable

import numpy as np

from shuffle_send_paths import leaving_round

WAYS = ("today", "direct", "bare")
#: iovecs per process_vm_readv call (Linux's IOV_MAX).
IOV_MAX = 1024
_IOVEC = np.dtype([("base", np.uint64), ("length", np.uint64)])
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                                   ctypes.c_ulong]


def read_from(pid: int, target: np.ndarray, at: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
    """``target[at[i]:][:lengths[i]] = `` process ``pid``'s bytes at address ``remote[i]``, IOV_MAX ranges a call."""
    here = np.empty(len(at), _IOVEC)
    there = np.empty(len(at), _IOVEC)
    here["base"], here["length"] = target.ctypes.data + at, lengths
    there["base"], there["length"] = remote, lengths
    for first in range(0, len(at), IOV_MAX):
        n = min(IOV_MAX, len(at) - first)
        want = int(lengths[first:first + n].sum())
        got = _libc.process_vm_readv(pid, here[first:].ctypes.data, n, there[first:].ctypes.data, n, 0)
        if got != want:
            raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {want} bytes from process {pid}")


def ways(store: Any) -> tuple[dict[str, Callable[[], None]], dict[str, np.ndarray]]:
    """One function per way of moving round 0's bytes, and the target each writes."""
    from mpi4py import MPI

    from dimd.shuffle.exchange import (META_DTYPE, _move, displacements, exchange_bytes, exchange_rows,
                                       gather_bytes)
    from dimd.shuffle.shm import Segment

    comm = store.group_comm
    size, rank = comm.Get_size(), comm.Get_rank()
    leaving, _, counts = leaving_round(store)
    staying = np.setdiff1d(np.arange(len(store)), leaving)   # in local order
    starts, lengths = store.locate(leaving)
    kept_starts, kept_lengths = store.locate(staying)
    rows = np.zeros(len(leaving), META_DTYPE)
    rows["length"], rows["index"] = lengths, starts + store.segment.array.ctypes.data   # the sender's addresses
    recv_rows, recv_counts = exchange_rows(comm, rows, counts)
    arriving = recv_rows["length"].astype(np.int64)
    kept = int(kept_lengths.sum())
    share = kept + int(arriving.sum())
    pids = comm.allgather(os.getpid())
    source = np.repeat(np.arange(size), recv_counts)
    land = kept + displacements(arriving)
    targets = {way: Segment(share + 1, f"bench-{way}").array for way in ("today", "direct")}
    for target in targets.values():
        target[:] = 0                     # touched, as the store's segments are
    send = np.zeros(int(lengths.sum()) + 1, np.uint8)
    bare_send = np.ones(comm.allreduce(share) // size + 1, np.uint8)
    segment = store.segment.array

    def today() -> None:
        sendbuf = gather_bytes(segment, starts, lengths, out=send)
        _move(targets["today"], displacements(kept_lengths), segment, kept_starts, kept_lengths)
        exchange_bytes(comm, sendbuf, rows, counts, recv_rows, recv_counts, targets["today"][kept:share])

    def direct() -> None:
        _move(targets["direct"], displacements(kept_lengths), segment, kept_starts, kept_lengths)
        for peer in range(size):
            mine = source == peer
            if peer != rank and mine.any():
                read_from(pids[peer], targets["direct"], land[mine], recv_rows["index"][mine].astype(np.uint64),
                          arriving[mine])
        comm.Barrier()                    # MPI: from here a sender may change its segment again

    blocks = np.full(size, comm.allreduce(share) // size // size, np.int64)   # the mean share, cut in P blocks
    bare_recv = np.zeros(int(blocks.sum()), np.uint8)

    def bare() -> None:
        comm.Alltoallv([bare_send, (blocks, displacements(blocks)), MPI.BYTE],
                       [bare_recv, (blocks, displacements(blocks)), MPI.BYTE])

    return {"today": today, "direct": direct, "bare": bare}, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a packed set (OUT of dimd pack)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    from dimd.mpi import init_mpi

    setup = init_mpi("single")
    from mpi4py import MPI

    from dimd.shuffle import DistributedStore

    world = MPI.COMM_WORLD
    store = DistributedStore.load(args.data, world)
    run, targets = ways(store)
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.reps):
        for way in WAYS:
            world.Barrier()
            start = time.perf_counter()
            run[way]()
            seconds[way].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    same = bool(world.allreduce(int(np.array_equal(targets["today"], targets["direct"])), op=MPI.MIN))
    if not same:
        raise SystemExit("direct reads left other bytes than today's shuffle")
    if world.Get_rank() == 0:
        from dimd.report import result_document, write_json

        median = {way: float(np.median(s[1:] or s)) for way, s in seconds.items()}
        figures = {"records": store.total, "seconds": seconds, "median_seconds": median, "same_bytes": same,
                   "today_over_bare": median["today"] / median["bare"],
                   "direct_over_bare": median["direct"] / median["bare"]}
        write_json(args.json, result_document("bench/probes/shuffle_direct_read.py", vars(args), figures,
                                              mpi=setup.as_dict()))
        print(" ".join(f"{way} {1e3 * v:.1f} ms" for way, v in median.items())
              + f"; today / bare {figures['today_over_bare']:.2f}, direct / bare {figures['direct_over_bare']:.2f}")


if __name__ == "__main__":
    main()
