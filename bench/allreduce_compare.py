#!/usr/bin/env python3
"""Every dimd allreduce against MPICH's own (default and forced algorithms) and gloo, medians of runs.

For each rank count and run, this launches

  mpiexec -n P dimd bench-allreduce -a all --peer gloo --json ...      (dimd + MPI default + gloo)
  mpiexec -n P dimd bench-allreduce -a mpi --json ...                  (once per forced MPICH algorithm,
      with MPIR_CVAR_DEVICE_COLLECTIVES=none MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=<alg>)

and prints, per P and size, the median time over runs (min-max spread) and
the median of the per-run ratios to the MPI library's default Allreduce
(each ratio taken against the baseline of the same run). Writes every run's
JSON and a summary JSON to --out.

  .venv/bin/python bench/allreduce_compare.py --ranks 2 4 --runs 3 --out /tmp/allreduce-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
# dimd algorithm -> the MPICH algorithm that is the same idea (forced for comparison)
MPICH_PEERS = {"ring": "ring", "recursive-doubling": "recursive_doubling",
               "rabenseifner": "reduce_scatter_allgather", "tree": "tree"}


def run_job(ranks: int, args: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "dimd"), "bench-allreduce", *args,
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--min-bytes", default="64K")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--factor", default="4")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("allreduce-results"))
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    sweep = ["-b", opts.min_bytes, "-e", opts.max_bytes, "-f", opts.factor]

    times: dict[tuple[int, str, int], list[float]] = {}
    ratios: dict[tuple[int, str, int], list[float]] = {}
    environment = {}
    for run in range(opts.runs):
        for ranks in opts.ranks:
            peer = [] if opts.no_gloo else ["--peer", "gloo"]
            doc = run_job(ranks, ["-a", "all", *peer, *sweep], opts.out / f"p{ranks}_run{run}_dimd.json")
            environment[ranks] = doc["mpi"]
            rows = list(doc["result"]["rows"])
            baseline = {r["bytes"]: r["time_us"] for r in rows if r["algorithm"] == "mpi"}
            for mpich in sorted(set(MPICH_PEERS.values())):
                forced = run_job(ranks, ["-a", "mpi", *sweep], opts.out / f"p{ranks}_run{run}_mpich_{mpich}.json",
                                 env={"MPIR_CVAR_DEVICE_COLLECTIVES": "none",
                                      "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": mpich})
                rows += [{**r, "algorithm": f"mpich:{mpich}"} for r in forced["rows"]]
            for r in rows:
                key = (ranks, r["algorithm"], r["bytes"])
                times.setdefault(key, []).append(r["time_us"])
                ratios.setdefault(key, []).append(r["time_us"] / baseline[r["bytes"]])
            print(f"run {run + 1}/{opts.runs}, P={ranks}: done", file=sys.stderr, flush=True)

    summary = []
    for (ranks, algorithm, nbytes), values in sorted(times.items()):
        summary.append({"ranks": ranks, "algorithm": algorithm, "bytes": nbytes, "runs": len(values),
                        "median_us": statistics.median(values), "min_us": min(values), "max_us": max(values),
                        "median_ratio_vs_mpi": statistics.median(ratios[(ranks, algorithm, nbytes)])})
    (opts.out / "summary.json").write_text(json.dumps({"environment": environment, "rows": summary}, indent=2))

    for ranks in opts.ranks:
        env = environment[ranks]
        print(f"\nP = {ranks} (thread level {env['thread_level_provided']}, progress throttle "
              f"{env['progress_throttle']}, {env['cores']} cores), medians of {opts.runs} runs: "
              "time us (min-max) and x MPI default")
        sizes = sorted({s["bytes"] for s in summary if s["ranks"] == ranks})
        found = {s["algorithm"] for s in summary if s["ranks"] == ranks}
        algorithms = sorted(found, key=lambda a: (a.startswith("mpich:"), a == "gloo", a))
        print("| algorithm | " + " | ".join(_label(b) for b in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for algorithm in algorithms:
            cells = []
            for nbytes in sizes:
                s = next(s for s in summary if (s["ranks"], s["algorithm"], s["bytes"]) == (ranks, algorithm, nbytes))
                cells.append(f"{s['median_us']:.0f} ({s['min_us']:.0f}-{s['max_us']:.0f}) "
                             f"{s['median_ratio_vs_mpi']:.2f}x")
            print(f"| {algorithm} | " + " | ".join(cells) + " |")


def _label(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


if __name__ == "__main__":
    main()
