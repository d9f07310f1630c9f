#!/usr/bin/env python3
"""A shuffle's byte-range copies, the loop in C against one Python call per record (docs/shuffle.md).

    mpiexec -n P python -m mpi4py bench/probes/shuffle_moves.py DATA --rounds 7 --json out.json

Loads DATA (a packed set) as ``dimd shuffle`` does and runs shuffle rounds
(seed 0, rounds 0, 1, ...), alternating the way the records are gathered and
packed down (:func:`dimd.shuffle.exchange._move`): ``c``, the compiled loop
(:mod:`dimd.shuffle._ranges`, what a shuffle uses), and ``python``, one
``ctypes.memmove`` call per range (what it used before, and still does
where the extension could not be built). Each round's time is the slowest
rank's; the figures are medians over the rounds after each way's first, and
their ratio. The sets in docs/shuffle.md are bench/shuffle_scaling.py's
``synthetic_pack`` at two mean record sizes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

WAYS = ("c", "python")


def time_rounds(store: Any, rounds: int) -> dict[str, list[float]]:
    """Each way's round times (slowest rank), the ways taking turns round after round."""
    from mpi4py import MPI

    from dimd.shuffle import exchange

    compiled = exchange._ranges
    if compiled is None:
        raise SystemExit("dimd.shuffle._ranges is not built in this install: nothing to compare")
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    comm = store.comm
    for r in range(rounds):
        for way in WAYS:
            exchange._ranges = compiled if way == "c" else None
            comm.Barrier()
            start = time.perf_counter()
            store.shuffle(0, 2 * r + WAYS.index(way))
            seconds[way].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    exchange._ranges = compiled
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a packed set (OUT of dimd pack)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of each way")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    from dimd.mpi import init_mpi

    setup = init_mpi("single")
    from mpi4py import MPI

    from dimd.shuffle import DistributedStore

    world = MPI.COMM_WORLD
    store = DistributedStore.load(args.data, world)
    seconds = time_rounds(store, args.rounds)
    data_bytes = int(world.allreduce(store.nbytes))
    if world.Get_rank() == 0:
        from dimd.report import result_document, write_json

        median = {way: float(np.median(s[1:] or s)) for way, s in seconds.items()}
        figures = {"records": store.total, "data_bytes": data_bytes,
                   "seconds": seconds, "median_seconds": median, "python_over_c": median["python"] / median["c"]}
        write_json(args.json, result_document("bench/probes/shuffle_moves.py", vars(args), figures,
                                              mpi=setup.as_dict()))
        print(f"{store.total} records: c {1e3 * median['c']:.1f} ms, python {1e3 * median['python']:.1f} ms, "
              f"python / c {figures['python_over_c']:.2f}")


if __name__ == "__main__":
    main()
