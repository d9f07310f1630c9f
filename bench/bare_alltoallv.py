#!/usr/bin/env python3
"""The limit of a shuffle: one bare MPI_Alltoallv of the same bytes, numpy buffers already in place.

    mpiexec -n P python -m mpi4py bench/bare_alltoallv.py --share BYTES --rounds R --groups G --json out.json

Each group of P/G consecutive ranks exchanges ``--share`` bytes per rank,
spread evenly (no record packing, no index rows); every round's time is the
slowest rank's. bench/shuffle_scaling.py draws it under `dimd shuffle`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=int, required=True, help="bytes each rank holds and exchanges")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    from dimd.mpi import init_mpi

    setup = init_mpi("single")
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() % args.groups:
        raise SystemExit(f"{world.Get_size()} ranks do not split into {args.groups} groups")
    comm = world.Split(world.Get_rank() // (world.Get_size() // args.groups), world.Get_rank())
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = np.full(size, args.share // size, np.int64)   # the same on every rank: sends match receives
    displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
    send = np.random.default_rng(rank).integers(0, 255, int(counts.sum()), dtype=np.uint8)
    recv = np.empty_like(send)
    seconds = []
    for _ in range(args.rounds):
        comm.Barrier()
        start = time.perf_counter()
        comm.Alltoallv([send, (counts, displs), MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
        seconds.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    moved = world.allreduce(int(counts.sum() - counts[rank]))   # bytes that left their rank, all ranks
    if world.Get_rank() == 0:
        from dimd.report import result_document, write_json

        write_json(args.json, result_document("bench/bare_alltoallv.py", vars(args),
                                              {"seconds": seconds, "bytes_moved": moved, "group_size": size},
                                              mpi=setup.as_dict()))


if __name__ == "__main__":
    main()
