#!/usr/bin/env python3
"""``make gpu-check``: every CUDA path of dimd and its headline ratios, in one command on one GPU.

    make gpu-check                                  # on a GPU machine: within 8 minutes on an H100, set-up included
    python bench/gpu_check.py --parts graphs,ranks  # some parts only
    python bench/gpu_check.py --budget 300          # stop starting work after 300 s

Whoever has a GPU machine at hand runs this first. The parts, in this order; each runs in processes of its own
under a time limit, and one that fails or runs out of time is reported (with the results of the jobs it
finished) while the next still runs:

1. ``tests``: ``pytest -m cuda`` over the test files that hold CUDA tests;
2. ``graphs``: CUDA graphs (bench/cuda_graphs.py, short): the step grid of resnet20 at 32 px (batch 16, K = 1, 2
   and 4 learners eager and graphed, S-SGD at batch 256 eager and graphed) and resnet18 at 224 px (batch 16,
   K = 1 and 4, against batch 128 eager), medians of 3 interleaved runs; then ``dimd train`` on a 32-px set
   (S-SGD at batch 16 eager and graphed, 4 graphed learners of 16, S-SGD at batch 256 eager), 3 epochs each;
3. ``ranks``: two ranks sharing the GPU for one S-SGD epoch (graphed: two graphs around the host allreduce);
4. ``nccl``: ``dimd bench-allreduce --device cuda`` on one rank (NCCL in device memory, the copies to the host
   and back alone, the host algorithms with them; 1 to 64 MiB and resnet50's gradients), then ``dimd train`` on
   one rank with ``--allreduce nccl`` against the default one-rank run (which skips the reduction): resnet20
   at 32 px, batch 16 (graphed), 4 epochs, 3 interleaved runs each (bench/gpu_allreduce.py's jobs, short);
5. ``feed``: a short bench/gpu_feed.py grid: resnet50 in 32-true and bf16-mixed and resnet18 in bf16-mixed at
   224 px, batch 128: the ceiling, ``dimd train`` and the DataLoader script, one run each on a small set.

It writes gpu_check.json in the results folder (again after every part: a check stopped midway keeps what it measured)
with each part's status, seconds and figures, the issue's targets against what was measured, and the machine;
and prints one table. Without a CUDA device it prints one line and exits 2. Exit status 0 when every part
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from _common import (BENCH, BIN, RESULTS, WORK, JobError, dimd_job, gpu_decode_workers, machine, no_cuda_line, run,
                     sample_set, time_left)

ROOT = BENCH.parent
PARTS = ("tests", "graphs", "ranks", "nccl", "feed")
#: Seconds after which no part starts (the 8 minutes of the check, less the set-up before it).
BUDGET_S = 420.0
#: The least time worth starting a part with.
MINIMUM_S = {"tests": 60.0, "graphs": 60.0, "ranks": 30.0, "nccl": 60.0, "feed": 45.0}
#: Each part's own limit (a part that hangs must not eat the rest).
LIMIT_S = {"tests": 200.0, "graphs": 160.0, "ranks": 60.0, "nccl": 120.0, "feed": 150.0}

#: The 32-px set of the graphs and ranks parts: 5,000 generated images packed at a short side of 36 px.
SMALL_SET = {"classes": 10, "per_class": 500, "val_per_class": 20, "short_side": 36}


def device_versions() -> dict[str, Any]:
    import torch

    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the parts
def cuda_test_files() -> list[Path]:
    """The test files that hold CUDA tests (``pytest.mark.cuda``)."""
    return sorted(p for p in (ROOT / "tests").glob("test_*.py") if "mark.cuda" in p.read_text(encoding="utf-8"))


def part_tests(deadline: float, folder: Path) -> dict[str, Any]:
    """``pytest -m cuda``: counts, and each failure's name and first line."""
    import xml.etree.ElementTree as ET

    report = folder / "pytest.xml"
    report.unlink(missing_ok=True)
    files = cuda_test_files()
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", *map(str, files)]
    output, error = "", None
    try:
        output = run(command, timeout=time_left(deadline), log=folder / "pytest.log")
    except JobError as exc:                     # failures: the report says which
        error = str(exc)
    except subprocess.TimeoutExpired:
        error = "timed out"
    figures: dict[str, Any] = {"files": [f.name for f in files]}
    if report.exists():
        suites = ET.parse(report).getroot()
        suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
        assert suite is not None
        figures.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        figures["failed"] = [f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}: "
                             f"{(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}"
                             for case in suite.iter("testcase")
                             for bad in [*case.findall("failure"), *case.findall("error")]]
    if error and not figures.get("failed"):
        figures["error"] = error.splitlines()[-1] if error else None
    figures["passed"] = error is None and report.exists()
    figures["tail"] = "\n".join(output.strip().splitlines()[-3:])
    return figures


def short_graphs_parameters() -> dict[str, Any]:
    import cuda_graphs

    return {**cuda_graphs.FULL, **SMALL_SET, "runs": 3, "seconds": 0.5, "train_epochs": 3}


def part_graphs(deadline: float, folder: Path) -> dict[str, Any]:
    import cuda_graphs

    p = short_graphs_parameters()
    figures: dict[str, Any] = {"parameters": {k: v for k, v in p.items() if k != "models"}}
    figures["step_grid"] = cuda_graphs.step_grids(p, folder, say, deadline=deadline)
    figures["train"] = cuda_graphs.train_runs(p, folder, say, WORK, gpu_decode_workers(), deadline=deadline)
    figures["passed"] = True
    return figures


def part_ranks(deadline: float, folder: Path) -> dict[str, Any]:
    """Two ranks on the one GPU, one S-SGD epoch at batch 16 (graphs by the default rule)."""
    data = sample_set(SMALL_SET["classes"], SMALL_SET["per_class"], SMALL_SET["val_per_class"], log=say,
                      short_side=SMALL_SET["short_side"])
    result = dimd_job(["train", data.train, "--val", data.val, "--model", "resnet20", "--image-size", 32,
                       "--batch-size", 16, "--epochs", 1, "--device", "cuda", "--decode-workers",
                       max(1, gpu_decode_workers() // 2), "--lr", 0.1, "--crop-scale", 0.35], folder / "two_ranks.json",
                      ranks=2, timeout=time_left(deadline))["result"]
    graphs = result["cuda_graphs"]
    passed = bool(result["replicas_identical"]) and result["epochs_run"] == 1
    return {"passed": passed, "images_per_s": result["images_per_s"],
            "replicas_identical": result["replicas_identical"], "allreduce": result["allreduce"],
            "time_split": result["time_split"], "cuda_graphs_rule": graphs["rule"],
            "graphs": [c["graph"] for c in graphs.get("captures", [])],
            "capture_seconds": graphs.get("capture_seconds"), "val_top1": result["val_top1"]}


#: The nccl part: bench/gpu_allreduce.py's jobs, short (the table's sizes, the one-rank runs' model and set).
NCCL_CHECK = {"algorithms": "mpi,ring", "min_bytes": 1 << 20, "max_bytes": 64 << 20, "factor": 4,
              "model": "resnet20", "precision": "32-true", "image_size": 32, "batch_size": 16, "epochs": 4,
              "runs": 3}


def part_nccl(deadline: float, folder: Path) -> dict[str, Any]:
    """The copies' and NCCL's cost per size on one GPU, and one rank's ``--allreduce nccl`` against the default."""
    import gpu_allreduce

    p = {**NCCL_CHECK, "workers": gpu_decode_workers()}
    table = gpu_allreduce.device_table(p, folder, timeout=time_left(deadline))
    data = sample_set(SMALL_SET["classes"], SMALL_SET["per_class"], SMALL_SET["val_per_class"], log=say,
                      short_side=SMALL_SET["short_side"])
    runs = gpu_allreduce.one_rank_runs(p, data, folder, say, deadline=deadline)
    rows = [{k: row[k] for k in ("bytes", "algorithm", "time_us", "busbw_gbs", "wrong")} for row in table["rows"]]
    passed = table["wrong_total"] == 0 and runs["choices"]["--allreduce nccl"]["allreduce"] == "nccl"
    return {"passed": passed, "parameters": p, "rows": rows, "gradient_bytes": table.get("gradient_bytes"), **runs}


def part_feed(deadline: float, folder: Path) -> dict[str, Any]:
    import gpu_feed

    p = {**gpu_feed.FULL, "setups": [("resnet50", "32-true"), ("resnet50", "bf16-mixed"), ("resnet18", "bf16-mixed")],
         "runs": 1, "epochs": 2, "per_class": 200, "ceiling_steps": 20, "workers": gpu_decode_workers(),
         "decodes": ["cpu"], "dataloader": gpu_feed.has_torchvision(), "loaders_alone": False}
    figures = gpu_feed.measure_grid(p, folder, say, WORK, deadline=deadline)
    return {**figures, "parameters": {k: v for k, v in p.items() if k not in ("models", "precisions")},
            "passed": True}


PART_FUNCTIONS: dict[str, Callable[[float, Path], dict[str, Any]]] = {
    "tests": part_tests, "graphs": part_graphs, "ranks": part_ranks, "nccl": part_nccl, "feed": part_feed}


# ----------------------------------------------------------------------------- targets and table
def targets(parts: dict[str, Any], wall_s: float) -> list[dict[str, Any]]:
    """The issue's targets against what this check measured (None where the part did not run)."""
    def grid_ratio(model: str, name: str) -> float | None:
        ratio = parts.get("graphs", {}).get("step_grid", {}).get(model, {}).get("ratios", {}).get(name)
        return ratio["median"] if ratio else None

    def best_sma(model: str, base: str) -> float | None:
        found = [grid_ratio(model, f"SMA 4x16 graphed ({how}) / {base}") for how in ("branches", "streams")]
        found = [r for r in found if r is not None]
        return max(found) if found else None

    train = parts.get("graphs", {}).get("train", {}).get("runs", {})
    share = train.get("S-SGD b16 graphed", {}).get("capture_share")
    rows = [("resnet20 32 px b16: S-SGD graphed / eager (step grid)", 5.0,
             grid_ratio("resnet20", "S-SGD b16 graphed / S-SGD b16 eager")),
            ("resnet20 32 px b16: S-SGD graphed / eager (dimd train)", 5.0,
             parts.get("graphs", {}).get("train", {}).get("ratios", {}).get("S-SGD b16 graphed / S-SGD b16 eager")),
            ("resnet20 32 px: 4 graphed learners of 16 / S-SGD b256 eager", 1.0,
             best_sma("resnet20", "S-SGD b256 eager")),
            ("resnet18 224 px: 4 graphed learners of 16 / S-SGD b128 eager", 0.95,
             best_sma("resnet18", "S-SGD b128 eager"))]
    nccl = parts.get("nccl", {}).get("over_default")
    rows.append(("one rank, resnet20 32 px b16: --allreduce nccl / default (dimd train)", 0.98,
                 nccl["median"] if nccl else None))
    out = [{"target": name, "at_least": bound, "measured": value, "met": None if value is None else value >= bound}
           for name, bound, value in rows]
    out.append({"target": "captures' share of a 3-epoch dimd train run (S-SGD b16)", "at_most": 0.05,
                "measured": share, "met": None if share is None else share < 0.05})
    out.append({"target": "make gpu-check's parts, seconds", "at_most": 480.0, "measured": wall_s,
                "met": wall_s <= 480.0})
    return out


def table(document: dict[str, Any]) -> str:
    import cuda_graphs

    result = document["result"]
    lines = [f"dimd GPU check on {result.get('gpu')} (torch {result.get('torch')}, CUDA {result.get('cuda')}): "
             f"{result['wall_seconds']:.0f} s", "", "| part | what | figure |", "|---|---|---|"]
    for name, part in result["parts"].items():
        lines.append(f"| {name} | status | {part['status']} in {part.get('seconds', 0):.0f} s"
                     + (f": {part['error']}" if part.get("error") else "") + " |")
        if name == "tests" and "tests" in part:
            lines.append(f"| tests | pytest -m cuda | {part['tests']} tests, {part['failures']} failed, "
                         f"{part['errors']} errors, {part['skipped']} skipped |")
            lines += [f"| tests | failed | {failure} |" for failure in part.get("failed", [])]
        if name == "graphs":
            for row in cuda_graphs.table(part):
                where, what, figure = row.split(" | ")
                lines.append(f"| graphs | {where}: {what} | {figure} |")
        if name == "ranks" and "images_per_s" in part:
            lines.append(f"| ranks | 2 ranks, 1 GPU, S-SGD b16 ({', '.join(part['graphs']) or 'eager'}) | "
                         f"{part['images_per_s']:,.0f} img/s, replicas identical {part['replicas_identical']} |")
        if name == "nccl" and "rows" in part:
            for algorithm in ("nccl", "d2h+h2d"):
                times = ", ".join(f"{row['bytes'] / 2**20:.4g} MiB {row['time_us']:,.0f} us" for row in part["rows"]
                                  if row["algorithm"] == algorithm and row["bytes"])
                lines.append(f"| nccl | bench-allreduce --device cuda, 1 rank: {algorithm} | {times} |")
            rates = ", ".join(f"{setup} {rate['median']:,.0f}" for setup, rate in part["train"].items())
            lines.append(f"| nccl | dimd train, 1 rank: {rates} img/s | {part['over_default']['median']:.3f}x "
                         f"({part['over_default']['min']:.3f}-{part['over_default']['max']:.3f}) |")
        if name == "feed" and "setups" in part:
            for key, setup in part["setups"].items():
                rates = ", ".join(f"{s} {v['median']:,.0f}" for s, v in setup["images_per_s"].items())
                lines.append(f"| feed | {key} | {rates} img/s |")
    for target in result["targets"]:
        bound = f">= {target['at_least']}" if "at_least" in target else f"<= {target['at_most']}"
        measured = "not measured" if target["measured"] is None else f"{target['measured']:.3g}"
        verdict = {True: "met", False: "NOT met", None: "-"}[target["met"]]
        lines.append(f"| target | {target['target']} ({bound}) | {measured}: {verdict} |")
    return "\n".join(lines)


def finished_jobs(folder: Path, since: float) -> dict[str, Any]:
    """The results of the jobs a part finished before it failed or ran out of time (each job's JSON in
    ``folder``, written after ``since``, time.monotonic()): a GPU session is short, and what it measured stays."""
    import json

    after = time.time() - (time.monotonic() - since)
    found: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            if path.stat().st_mtime >= after:
                found[path.stem] = json.loads(path.read_text(encoding="utf-8")).get("result")
        except (OSError, ValueError):   # a job cut off while it wrote: nothing to keep
            continue
    return found


# ----------------------------------------------------------------------------- the check
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds after which no part starts")
    parser.add_argument("--json", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args(argv)
    chosen = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in PARTS]
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    problem = no_cuda_line("bench/gpu_check.py", "checks dimd on a GPU")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from dimd.report import result_document, write_json

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    started = time.monotonic()
    folder = WORK / "runs" / "gpu_check"
    folder.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {**device_versions(), "python": sys.executable, "bin": str(BIN), "parts": {}}

    def write() -> dict[str, Any]:
        result["wall_seconds"] = time.monotonic() - started
        result["targets"] = targets(result["parts"], result["wall_seconds"])
        document = result_document("bench/gpu_check.py", {"parts": chosen, "budget": args.budget},
                                   {**result, "machine": machine()})
        write_json(args.json, document)
        return document

    for name in chosen:
        left = args.budget - (time.monotonic() - started)
        if left < MINIMUM_S[name]:
            result["parts"][name] = {"status": "skipped", "error": f"out of time ({left:.0f} s left)"}
            write()
            continue
        say(f"gpu-check: {name} (at most {min(left, LIMIT_S[name]):.0f} s)")
        t0 = time.monotonic()
        deadline = t0 + min(left, LIMIT_S[name])
        try:
            figures = PART_FUNCTIONS[name](deadline, folder)
            status = "passed" if figures.pop("passed", True) else "failed"
            part = {"status": status, **figures}
        except subprocess.TimeoutExpired:
            part = {"status": "timed out", "error": f"past its {deadline - t0:.0f} s",
                    "finished_jobs": finished_jobs(folder, since=t0)}
        except Exception as exc:   # reported, and the next part still runs
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            part = {"status": "failed", "error": lines[-1][:300], "detail": "\n".join(lines[-12:]),
                    "traceback": traceback.format_exc(limit=4)[-2000:],
                    "finished_jobs": finished_jobs(folder, since=t0)}
        part["seconds"] = time.monotonic() - t0
        result["parts"][name] = part
        write()
    document = write()
    print(table(document))
    print(f"\n{args.json} written", file=sys.stderr)
    return 0 if all(part["status"] == "passed" for part in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
