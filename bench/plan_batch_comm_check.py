#!/usr/bin/env python3
"""Held-out check of the allreduce cost models on the summary `bench/allreduce_compare.py` writes.

`dimd plan-batch comm` reads `bench-allreduce` results; the quiet-machine
comparison in `bench/allreduce_results_quiet.json` keeps only medians of 3 runs
per (P, algorithm, size). This script feeds those medians to the same fit
(`dimd.train.plan.commfit`): fit each algorithm on some rank counts, predict
the others, and print and write the relative errors. It separates the model's
error from a busy machine's noise.

  .venv/bin/python bench/plan_batch_comm_check.py bench/allreduce_results_quiet.json --fit 2 \\
      --out bench/results/plan_batch_comm_check_quiet.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dimd.report import result_document, write_json
from dimd.train.plan.commfit import Sample, holdout_check
from dimd.train.plan.commmodel import COST_MODELS


def samples_from_summary(path: Path) -> list[Sample]:
    summary = json.loads(path.read_text())
    environment = summary["environment"]
    out = []
    for row in summary["rows"]:
        if row["algorithm"] not in COST_MODELS:
            continue
        env = environment[str(row["ranks"])]
        job_cores = env["cores"] * row["ranks"] / (env.get("local_ranks") or row["ranks"])
        out.append(Sample(row["algorithm"], row["ranks"], row["bytes"], row["median_us"] * 1e-6, job_cores,
                          repeats=row.get("runs", 1)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", type=Path)
    parser.add_argument("--fit", type=int, nargs="+", default=[2], help="rank counts to fit on; the rest are held out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    samples = samples_from_summary(args.summary)
    held = sorted({s.ranks for s in samples} - set(args.fit))
    figures = {"source": str(args.summary), "fit_ranks": args.fit, "holdout_ranks": held, "algorithms": {}}
    print(f"fit on P = {args.fit}, predict P = {held} ({args.summary})")
    print(f"{'algorithm':<20}{'median |err|':>14}{'max |err|':>11}  errors by size")
    for name in COST_MODELS:
        mine = [s for s in samples if s.algorithm == name]
        check = holdout_check(mine, held) if mine else None
        if check is None:
            continue
        figures["algorithms"][name] = check
        errors = [f"{r['relative_error']:+.2f}" for per in check["per_ranks"] for r in per["rows"]]
        print(f"{name:<20}{check['median_abs_error']:>14.2f}{check['max_abs_error']:>11.2f}  {' '.join(errors)}")
    if args.out:
        write_json(args.out, result_document("bench/plan_batch_comm_check.py", vars(args), figures))


if __name__ == "__main__":
    main()
