#!/usr/bin/env python
"""Shuffle time and bandwidth against ranks and groups (DIMD paper, Figures 7-9, at small scale).

Writes a synthetic packed set of random bytes with ImageNet-like record sizes
(a shuffle never decodes, so the content does not matter; its size does),
then for each (ranks, groups) runs the real command

    mpiexec -n P dimd shuffle DATA --groups G --rounds R --json ...

--repeats times and reports, per configuration, the median over repeats of
the median round time (max over ranks), the bytes moved per round, the
aggregate GB/s, the load time and the largest resident memory of a rank.
A bare MPI_Alltoallv of the same byte counts (numpy buffers already in place,
no record packing, no index rows) is measured alongside as the baseline, so
the ratio says what the record bookkeeping costs. --json PATH writes it all.

    .venv/bin/python bench/shuffle_scaling.py --size 512M --ranks 2 4 --groups 1 2 --json shuffle-bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

BARE_ALLTOALLV = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from dimd.mpi import init_mpi
    init_mpi("single")
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    share, rounds, groups = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    comm = world.Split(world.Get_rank() // (world.Get_size() // groups), world.Get_rank())
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = np.full(size, share // size, np.int64)  # the same on every rank, so sends match receives
    share = int(counts.sum())
    displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
    send = np.random.default_rng(rank).integers(0, 255, share, dtype=np.uint8)
    recv = np.empty_like(send)
    times = []
    for _ in range(rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Alltoallv([send, (counts, displs), MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
        times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    moved = world.allreduce(int(share - counts[rank]))
    if world.Get_rank() == 0:
        print(json.dumps({"seconds": times, "bytes_moved": moved}))
""")


def synthetic_pack(stem: Path, total_bytes: int, mean_record: int, seed: int) -> int:
    """Random-byte records with log-normal sizes around ``mean_record``; returns the record count."""
    from dimd.format import PackedRecord, PackWriter

    rng = np.random.default_rng(seed)
    sizes = []
    while sum(sizes) < total_bytes:
        sizes.extend(np.clip(rng.lognormal(np.log(mean_record), 0.5, 4096), 2_000, 2_000_000).astype(int))
    sizes = np.array(sizes)
    sizes = sizes[: int(np.searchsorted(np.cumsum(sizes), total_bytes)) + 1]
    pool = rng.integers(0, 256, int(sizes.max()) + 4096, dtype=np.uint8).tobytes()
    with PackWriter(stem, force=True) as writer:
        for i, n in enumerate(sizes.tolist()):
            start = int(rng.integers(0, 4096))
            writer.add(PackedRecord(pool[start : start + n], i % 1000, f"synthetic/{i:08d}", 256, 256))
        writer.commit([f"c{i}" for i in range(1000)], short_side=256, quality=0, source="synthetic")
    return len(sizes)


def run_shuffle(stem: Path, ranks: int, groups: int, rounds: int, out: Path) -> dict:
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, "-m", "dimd", "shuffle", str(stem),
           "--groups", str(groups), "--rounds", str(rounds), "--quiet", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return json.loads(out.read_text())["result"]


def run_bare(ranks: int, groups: int, share: int, rounds: int, script: Path) -> dict:
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, str(script), str(share), str(rounds),
           str(groups)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from dimd.units import format_bytes, parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512M", help="synthetic data set size (default 512M)")
    parser.add_argument("--mean-record", default="110K", help="mean record size (default 110K, ImageNet at 256 px)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="where the synthetic set goes (default: a temp dir)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dimd-shuffle-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stem = workdir / "synthetic"
    records = synthetic_pack(stem, parse_size(args.size), parse_size(args.mean_record), seed=0)
    data_bytes = stem.with_suffix(".dimd").stat().st_size
    print(f"synthetic set: {records} records, {format_bytes(data_bytes)} in {workdir}")
    bare_script = workdir / "bare_alltoallv.py"
    bare_script.write_text(BARE_ALLTOALLV)

    rows = []
    print(f"{'ranks':>5} {'groups':>6} {'load s':>8} {'shuffle s':>10} {'moved':>10} {'GB/s':>7} "
          f"{'bare s':>8} {'bare GB/s':>9} {'dimd/bare':>9} {'max RSS':>10}")
    for ranks in args.ranks:
        for groups in args.groups:
            if ranks % groups:
                continue
            docs = [run_shuffle(stem, ranks, groups, args.rounds, workdir / f"s{ranks}_{groups}_{k}.json")
                    for k in range(args.repeats)]
            shuffle_s = statistics.median(d["summary"]["seconds_median"] for d in docs)
            moved = statistics.median(d["summary"]["bytes_moved_median"] for d in docs)
            load_s = statistics.median(d["load"]["seconds"] for d in docs)
            rss = max(max(r["resident_bytes"]) for d in docs for r in d["rounds"])
            spread = [d["summary"]["seconds_median"] for d in docs]
            # the bare baseline: every group Alltoallv's a share of the same size, evenly spread
            group_size = ranks // groups
            bare = None
            if group_size > 1:
                share = data_bytes // group_size
                bare_runs = [run_bare(ranks, groups, share, args.rounds, bare_script)
                             for _ in range(args.repeats)]
                bare_s = statistics.median(statistics.median(b["seconds"]) for b in bare_runs)
                bare = {"seconds_median": bare_s, "bytes_moved": bare_runs[0]["bytes_moved"],
                        "gb_per_s": bare_runs[0]["bytes_moved"] / bare_s / 1e9}
            row = {"ranks": ranks, "groups": groups, "group_size": group_size, "load_seconds": load_s,
                   "shuffle_seconds_median": shuffle_s, "shuffle_seconds_runs": spread,
                   "bytes_moved": moved, "gb_per_s": moved / shuffle_s / 1e9 if shuffle_s else 0.0,
                   "max_resident_bytes": rss, "bare_alltoallv": bare,
                   "dimd_over_bare_time": shuffle_s / bare["seconds_median"] if bare else None}
            rows.append(row)
            print(f"{ranks:>5} {groups:>6} {load_s:>8.3f} {shuffle_s:>10.4f} {format_bytes(moved):>10} "
                  f"{row['gb_per_s']:>7.3f} "
                  + (f"{bare['seconds_median']:>8.4f} {bare['gb_per_s']:>9.3f} {row['dimd_over_bare_time']:>9.2f}"
                     if bare else f"{'-':>8} {'-':>9} {'-':>9}")
                  + f" {format_bytes(rss):>10}")
    if args.json:
        from dimd.report import result_document, write_json

        write_json(args.json, result_document("bench/shuffle_scaling.py", vars(args),
                                              {"records": records, "data_bytes": data_bytes, "rows": rows}))


if __name__ == "__main__":
    main()
