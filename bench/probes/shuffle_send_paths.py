#!/usr/bin/env python3
"""Ways to send a shuffle's leaving records, timed on the same round, interleaved (docs/shuffle.md).

    mpiexec -n P python -m mpi4py bench/probes/shuffle_send_paths.py DATA --reps 7 --json out.json

Loads DATA (a packed set) as ``dimd shuffle`` does, takes the records that
round 0 of seed 0 moves to another rank, and sends them to the ranks that
receive them in a shuffle, ``--reps`` times each way in turn:

- ``gather-new``: packed by :func:`gather_bytes` into a new array, one
  ``Alltoallv`` (the shuffle before the send buffer was kept);
- ``gather-kept``: packed into the same, already touched, buffer every time,
  one ``Alltoallv`` (the shuffle now);
- ``alltoallw``: no packing: one ``MPI_Type_create_hindexed`` of the records
  per destination, over the store's segment, one ``Alltoallw``;
- ``isend-records``: no packing: one ``Isend``/``Irecv`` per record, straight
  from the segment;
- ``gather-pipelined``: packed into the kept buffer one destination at a
  time, each block sent (``Isend``) as soon as it is packed, starting with
  the next rank; the ``Irecv`` are posted after every block is packed, as the
  shuffle can only receive once its leaving records are out of the segment.

Every way receives into one shared-memory segment, as the shuffle does, and
must deliver the same bytes. Each time is the slowest rank's; the figures are
medians over the repetitions after the first.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

PATHS = ("gather-new", "gather-kept", "alltoallw", "isend-records", "gather-pipelined")


def leaving_round(store: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local indices of the records that leave in round 0 of seed 0, grouped by destination; destinations; counts)."""
    from dimd.shares import balanced_bounds

    comm = store.group_comm
    size, rank = comm.Get_size(), comm.Get_rank()
    bounds = balanced_bounds(store.total, size)
    dest = np.searchsorted(bounds, store.placement(0, 0)[store.global_index], side="right") - 1
    leaving = np.flatnonzero(dest != rank)
    leaving = leaving[np.argsort(dest[leaving], kind="stable")]
    return leaving, dest[leaving], np.bincount(dest[leaving], minlength=size)


def senders(store: Any, recv: np.ndarray) -> dict[str, Callable[[], None]]:
    """One function per way of sending this round's leaving records into ``recv``."""
    from mpi4py import MPI

    from dimd.shuffle.exchange import META_DTYPE, block_sums, displacements, exchange_rows, gather_bytes

    comm, segment = store.group_comm, store.segment.array
    size = comm.Get_size()
    leaving, dest, counts = leaving_round(store)
    starts, lengths = store.locate(leaving)
    rows = np.zeros(len(leaving), META_DTYPE)
    rows["length"] = lengths
    recv_rows, recv_counts = exchange_rows(comm, rows, counts)
    send_bytes, recv_bytes = block_sums(lengths, counts), block_sums(recv_rows["length"], recv_counts)
    recv_at = displacements(recv_rows["length"].astype(np.int64))
    source = np.repeat(np.arange(size), recv_counts)
    kept = np.ones(int(lengths.sum()), np.uint8)
    edges = np.concatenate(([0], np.cumsum(counts)))
    recv_spec = [recv, (recv_bytes, displacements(recv_bytes)), MPI.BYTE]

    def alltoallv(sendbuf: np.ndarray) -> None:
        comm.Alltoallv([sendbuf, (send_bytes, displacements(send_bytes)), MPI.BYTE], recv_spec)

    def alltoallw() -> None:
        types = [MPI.BYTE.Create_hindexed(lengths[a:b].tolist(), starts[a:b].tolist()).Commit()
                 for a, b in zip(edges[:-1], edges[1:])]
        comm.Alltoallw([segment, ((counts > 0).astype(np.int64), np.zeros(size, np.int64)), types],
                       [recv, (recv_bytes, displacements(recv_bytes)), [MPI.BYTE] * size])
        for t in types:
            t.Free()

    def isend_records() -> None:
        requests = [comm.Irecv([recv[a : a + n], MPI.BYTE], source=s, tag=5)
                    for a, n, s in zip(recv_at.tolist(), recv_rows["length"].tolist(), source.tolist())]
        requests += [comm.Isend([segment[a : a + n], MPI.BYTE], dest=d, tag=5)
                     for a, n, d in zip(starts.tolist(), lengths.tolist(), dest.tolist())]
        MPI.Request.Waitall(requests)

    def gather_pipelined() -> None:
        rank = comm.Get_rank()
        send_at = displacements(send_bytes)
        requests = []
        for d in [(rank + k) % size for k in range(1, size)]:
            a, b = edges[d], edges[d + 1]
            gather_bytes(segment, starts[a:b], lengths[a:b], out=kept[send_at[d]:])
            requests.append(comm.Isend([kept[send_at[d] : send_at[d] + send_bytes[d]], MPI.BYTE], dest=d, tag=6))
        recv_displs = displacements(recv_bytes)
        requests += [comm.Irecv([recv[recv_displs[s] : recv_displs[s] + recv_bytes[s]], MPI.BYTE], source=s, tag=6)
                     for s in range(size) if recv_bytes[s]]
        MPI.Request.Waitall(requests)

    return {"gather-new": lambda: alltoallv(gather_bytes(segment, starts, lengths)),
            "gather-kept": lambda: alltoallv(gather_bytes(segment, starts, lengths, out=kept)),
            "alltoallw": alltoallw, "isend-records": isend_records,
            "gather-pipelined": gather_pipelined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a packed set (OUT of dimd pack)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    from dimd.mpi import init_mpi

    setup = init_mpi("single")
    from mpi4py import MPI

    from dimd.shuffle import DistributedStore
    from dimd.shuffle.shm import Segment

    world = MPI.COMM_WORLD
    store = DistributedStore.load(args.data, world)
    leaving, _, counts = leaving_round(store)
    arriving = store.group_comm.alltoall(counts.tolist())   # records from each rank
    received = Segment(int(store.group_comm.allreduce(int(store.locate(leaving)[1].sum())) * 2), "bench-recv")
    received.array[:] = 0                                  # touched, like the store's segment
    ways = senders(store, received.array)
    paths = args.paths.split(",")
    seconds: dict[str, list[float]] = {p: [] for p in paths}
    expected = None
    for _ in range(args.reps):
        for path in paths:
            received.array[:] = 0
            world.Barrier()
            start = time.perf_counter()
            ways[path]()
            seconds[path].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
            got = hash(received.array.tobytes())
            expected = got if expected is None else expected
            if got != expected:
                raise SystemExit(f"{path} delivered other bytes than {paths[0]}")
    moved = world.allreduce(int(store.locate(leaving)[1].sum()))
    if world.Get_rank() == 0:
        from dimd.report import result_document, write_json

        figures = {"seconds": seconds, "bytes_moved": moved, "records_arriving_rank0": sum(arriving),
                   "median_seconds": {p: float(np.median(s[1:] or s)) for p, s in seconds.items()}}
        write_json(args.json, result_document("bench/probes/shuffle_send_paths.py", vars(args), figures,
                                              mpi=setup.as_dict()))
        print(" ".join(f"{p} {1e3 * v:.1f} ms" for p, v in figures["median_seconds"].items()))


if __name__ == "__main__":
    main()
