#!/usr/bin/env python
"""Check that the shuffle's exchange moves more than 2 GiB to one rank in one Alltoallv.

MPI's classic counts are 32-bit ints; the shuffle passes int64 counts and
mpi4py >= 4 calls the MPI-4 large-count collective (``MPI_Alltoallv_c``).
This runs :func:`dimd.shuffle.exchange.alltoallv_records` on 2 ranks, each
sending ``--gib`` GiB (default 2.125, above the 2 GiB limit) to the other as
64 MiB records, and checks a marker at the start and end of every record.
The send buffers are zero pages touched only at the markers, so each rank
really allocates about the receive size. Too slow and too big for the test
suite (about 2 x 2.2 GB of memory), hence a script:

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/probes/shuffle_large_count.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.125, help="GiB each rank sends to the other")
    args = parser.parse_args()

    from dimd.mpi import init_mpi

    init_mpi("single")
    from mpi4py import MPI

    from dimd.shuffle.exchange import META_DTYPE, alltoallv_records

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if size != 2:
        raise SystemExit("run with mpiexec -n 2")
    record = 64 << 20
    count = int(args.gib * (1 << 30)) // record
    other = 1 - rank
    meta = np.zeros(count, META_DTYPE)
    meta["index"] = rank * count + np.arange(count)
    meta["length"] = record
    sendbuf = np.zeros(count * record, np.uint8)  # untouched zero pages, except the markers
    for i in range(count):
        sendbuf[i * record] = 1 + (i + rank) % 200
        sendbuf[(i + 1) * record - 1] = 1 + (i + 2 * rank) % 200
    counts = np.zeros(size, np.int64)
    counts[other] = count
    comm.Barrier()
    start = time.perf_counter()
    received = alltoallv_records(comm, sendbuf, meta, counts)
    seconds = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    del sendbuf
    ok = len(received.data) == count * record and np.array_equal(
        received.meta["index"], other * count + np.arange(count))
    for i in range(count):
        ok = ok and received.data[i * record] == 1 + (i + other) % 200
        ok = ok and received.data[(i + 1) * record - 1] == 1 + (i + 2 * other) % 200
    everyone = comm.allgather(bool(ok))
    if rank == 0:
        print(json.dumps({"bytes_per_rank": count * record, "above_2GiB": count * record > 2**31 - 1,
                          "seconds": seconds, "gb_per_s": 2 * count * record / seconds / 1e9,
                          "correct_on_every_rank": all(everyone)}))
    sys.exit(0 if all(everyone) else 1)


if __name__ == "__main__":
    main()
