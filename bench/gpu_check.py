#!/usr/bin/env python3
"""``make gpu-check``: every CUDA path of dimd and its headline ratios, in one command on one GPU, priced to 7 minutes.

    make gpu-check                                  # on a GPU machine
    python bench/gpu_check.py --plan                # its jobs and the seconds each is priced at (no GPU needed)
    python bench/gpu_check.py --parts graphs,ranks  # some parts only
    python bench/gpu_check.py --budget 300          # a shorter check: parts past 300 s are cut or skipped

Whoever has a GPU machine at hand runs this first. Every job it launches is priced before it starts
(bench/gpu_costs.py), and the prices add up to at most the budget of 420 s. In this order, each in processes
of its own:

0. ``prepare``: the two generated sample sets, built once, side by side (32 px for graphs, ranks and nccl;
   224 px for feed);
1. ``tests``: ``pytest -m cuda`` over the test files that hold CUDA tests;
2. ``graphs``: CUDA graphs (bench/cuda_graphs.py, short): the step grid of resnet20 at 32 px (S-SGD at batch 16
   and 256, eager and graphed; 4 learners of 16 as one graph of branches and as 4 graphs on 4 streams) and
   resnet18 at 224 px (batch 16 and 128, the same 4 learners), medians of 3 interleaved runs; then ``dimd
   train`` on the 32-px set (S-SGD at batch 16 eager and graphed, 4 graphed learners of 16), 3 epochs each;
3. ``ranks``: two ranks sharing the GPU for one S-SGD epoch (graphed: two graphs around the host allreduce);
4. ``nccl``: ``dimd bench-allreduce --device cuda`` on one rank (NCCL in device memory, the copies to the host
   and back alone, the host algorithms with them; 1 to 64 MiB and resnet50's gradients), then ``dimd train`` on
   one rank with ``--allreduce nccl`` against the default one-rank run (which skips the reduction): resnet20
   at 32 px, batch 16 (graphed), 2 epochs, 2 interleaved runs each;
5. ``feed``: a short bench/gpu_feed.py grid at 224 px, batch 128: resnet50 in 32-true and resnet18 in
   bf16-mixed, the ceiling, ``dimd train`` and the DataLoader script, one run each.

A step may run until the check's start plus the prices of the steps up to it: time one leaves unused passes
to the next, and none ends later than its own price allows. One that fails or runs out of time is reported,
with the results of the jobs it finished, and the next still runs. It writes gpu_check.json in the results
folder (again after every step: a check stopped midway keeps what it measured) with the plan, each step's
status, seconds and figures, each target as measured or not measured, and the machine; and prints one table.
Without a CUDA device it prints one line and exits 2 (``--plan`` needs none). Exit status 0 when every step
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from _common import (BENCH, BIN, RESULTS, WORK, JobError, SampleSet, dimd_job, gpu_decode_workers, machine,
                     no_cuda_line, run, sample_set, time_left)
from gpu_costs import DIMD_LOADER_RATES, Costs, Job, step_rate

ROOT = BENCH.parent
PARTS = ("tests", "graphs", "ranks", "nccl", "feed")
#: Seconds the check may take (its 7 minutes: `make gpu-check` within 8 on an H100, bench/gpu_setup.sh included).
BUDGET_S = 420.0
#: The check's whole time, set-up included, as the target says it.
TARGET_S = 480.0
COSTS = Costs()


@dataclass(frozen=True)
class SetSpec:
    """A generated sample set: ``classes`` x ``per_class`` training images and ``val_per_class`` per class for
    validation, packed at ``short_side``; ``large_share`` as ``dimd sample-data`` takes it (None: its default)."""

    classes: int
    per_class: int
    val_per_class: int
    short_side: int
    large_share: float | None = None

    @property
    def images(self) -> int:
        return self.classes * self.per_class

    @property
    def epoch_images(self) -> int:
        """What one epoch of ``dimd train`` reads: the training images, then the validation ones."""
        return self.classes * (self.per_class + self.val_per_class)

    def build(self, work: Path, deadline: float) -> SampleSet:
        return sample_set(self.classes, self.per_class, self.val_per_class, work=work, log=say,
                          short_side=self.short_side, large_share=self.large_share, deadline=deadline)


#: The sets the parts train on. 32 px: 2,500 images (157 steps of 16 an epoch), packed at a short side
#: of 36 px, without sample-data's large images (they would only cost time). 224 px: 2,000 (15 steps of 128).
SETS = {"32 px": SetSpec(10, 250, 20, 36, large_share=0.0), "224 px": SetSpec(10, 200, 20, 256)}


def device_versions() -> dict[str, Any]:
    import torch

    return {"gpu": torch.cuda.get_device_name(0), "gpus": gpu_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Turn:
    """What a part runs with: the time it must end by (time.monotonic()), a folder for its jobs' JSON and logs,
    and the sample sets the prepare step built."""

    deadline: float
    folder: Path
    data: dict[str, SampleSet]


@dataclass(frozen=True)
class Part:
    """One part of the check: the sample sets it trains on, its jobs priced (before it runs), and its run."""

    name: str
    sets: tuple[str, ...]
    jobs: Callable[[Costs, dict[str, SetSpec]], list[Job]]
    run: Callable[[Turn], dict[str, Any]]


# ----------------------------------------------------------------------------- tests
def cuda_test_files() -> list[Path]:
    """The test files that hold CUDA tests (``pytest.mark.cuda``)."""
    return sorted(p for p in (ROOT / "tests").glob("test_*.py") if "mark.cuda" in p.read_text(encoding="utf-8"))


def count_tests(path: Path) -> int:
    """The tests ``path`` defines, each parametrised case counted (the literal parameter lists)."""
    total = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            cases = 1
            for decorator in node.decorator_list:
                if (isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"
                        and len(decorator.args) > 1):
                    try:
                        cases *= len(ast.literal_eval(decorator.args[1]))
                    except ValueError:   # built by code: counted as one
                        pass
            total += cases
    return total


def tests_jobs(costs: Costs, sets: dict[str, SetSpec]) -> list[Job]:
    files = cuda_test_files()
    tests = sum(count_tests(f) for f in files)
    return [Job(f"pytest -m cuda: {tests} tests in {', '.join(f.name for f in files)}", costs.cuda_tests(tests))]


#: A test's outcome as ``pytest -v`` prints it, one line as each test ends.
OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)


def part_tests(turn: Turn) -> dict[str, Any]:
    """``pytest -m cuda``: counts, and each failure's name and first line; cut off, the tests it finished."""
    import xml.etree.ElementTree as ET

    report, log = turn.folder / "pytest.xml", turn.folder / "pytest.log"
    report.unlink(missing_ok=True)
    files = cuda_test_files()
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider",
               f"--junitxml={report}", *map(str, files)]
    output, error = "", None
    try:
        output = run(command, timeout=time_left(turn.deadline), log=log)
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
    elif log.exists():                          # cut off before pytest wrote its report: what it printed
        outcomes = OUTCOME.findall(log.read_text(encoding="utf-8", errors="replace"))
        figures["finished"] = {name: outcome for name, outcome in outcomes}
    if error and not figures.get("failed"):
        figures["error"] = error.splitlines()[-1] if error else None
    figures["passed"] = error is None and report.exists()
    figures["tail"] = "\n".join(output.strip().splitlines()[-3:])
    return figures


# ----------------------------------------------------------------------------- graphs
#: The graphs part: the step grids (set-ups as bench/cuda_graphs.py writes them) and dimd train on the 32-px set.
GRAPHS = {"models": {"resnet20": (32, ("ssgd:16:eager", "ssgd:16:graphed", "sma:16x4:branches", "sma:16x4:loop",
                                       "ssgd:256:eager", "ssgd:256:graphed")),
                     "resnet18": (224, ("ssgd:16:eager", "ssgd:16:graphed", "sma:16x4:branches", "sma:16x4:loop",
                                        "ssgd:128:eager", "ssgd:128:graphed"))},
          "runs": 3, "seconds": 0.25,
          "train_setups": ["S-SGD b16 eager", "S-SGD b16 graphed", "SMA 4x16 graphed"], "train_epochs": 3,
          "set": "32 px"}


def option(options: list[Any], flag: str, default: Any = None) -> Any:
    """The value after ``flag`` in a command line's options, or ``default``."""
    return options[options.index(flag) + 1] if flag in options else default


def train_shape(options: list[Any]) -> tuple[int, int, bool, int]:
    """A dimd train set-up's batch, learners, whether graphed, and the graphs it captures on one rank (SMA's
    learners by dimd train's default: one graph each, and its synchronisation)."""
    import cuda_graphs

    batch, learners = int(option(options, "--batch-size")), int(option(options, "--learners", 1))
    setup = cuda_graphs.Setup("sma" if learners > 1 else "ssgd", batch, learners,
                              "loop" if "--cuda-graphs" in options else "eager")
    return batch, learners, setup.graphed, setup.graphs


def graphs_jobs(costs: Costs, sets: dict[str, SetSpec]) -> list[Job]:
    import cuda_graphs

    p, jobs = GRAPHS, []
    for model, (size, texts) in p["models"].items():
        setups = [cuda_graphs.Setup.parse(text) for text in texts]
        timings = [max(p["seconds"], cuda_graphs.AT_LEAST_STEPS * s.images
                       / step_rate(model, size, s.batch, s.learners, s.graphed)) for s in setups]
        graphs = sum(s.graphs for s in setups)
        jobs.append(Job(f"step grid {model} {size} px: {len(setups)} set-ups ({graphs} graphs), {p['runs']} runs "
                        f"of {p['seconds']} s", costs.grid(timings, graphs, p["runs"])))
    data, setups = sets[p["set"]], dict(cuda_graphs.TRAIN_SETUPS)
    for name in p["train_setups"]:
        batch, learners, graphed, graphs = train_shape(setups[name])
        rate = step_rate("resnet20", 32, batch, learners, graphed)
        jobs.append(Job(f"dimd train resnet20 {name}: {p['train_epochs']} epochs of {data.images:,} images",
                        costs.train(images=data.epoch_images, epochs=p["train_epochs"], step=rate,
                                    loader=DIMD_LOADER_RATES[32], graphs=graphs)))
    return jobs


def part_graphs(turn: Turn) -> dict[str, Any]:
    import cuda_graphs

    p = GRAPHS
    figures: dict[str, Any] = {"parameters": {k: v for k, v in p.items() if k != "models"}}
    figures["step_grid"] = cuda_graphs.step_grids(p, turn.folder, say, deadline=turn.deadline)
    figures["train"] = cuda_graphs.train_runs(p, turn.folder, say, WORK, gpu_decode_workers(),
                                              deadline=turn.deadline, data=turn.data[p["set"]])
    figures["passed"] = True
    return figures


# ----------------------------------------------------------------------------- ranks
#: Two ranks on the one GPU, one S-SGD epoch at batch 16 (graphs by the default rule: a forward and an update
#: graph around the host allreduce).
RANKS = {"ranks": 2, "batch_size": 16, "epochs": 1, "graphs": 2, "set": "32 px"}


def ranks_jobs(costs: Costs, sets: dict[str, SetSpec]) -> list[Job]:
    p, data = RANKS, sets[RANKS["set"]]
    return [Job(f"mpiexec -n {p['ranks']} dimd train resnet20 b{p['batch_size']} graphed: {p['epochs']} epoch of "
                f"{data.images:,} images", costs.train(images=data.epoch_images, epochs=p["epochs"], ranks=p["ranks"],
                                                       step=step_rate("resnet20", 32, p["batch_size"], graphed=True),
                                                       loader=DIMD_LOADER_RATES[32], graphs=p["graphs"]))]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def part_ranks(turn: Turn) -> dict[str, Any]:
    p, data = RANKS, turn.data[RANKS["set"]]
    gpus = gpu_count()
    if gpus < p["ranks"]:   # dimd gives each rank a GPU of its own (docs/batch-jobs.md): not a failure, not a pass
        return {"not_measured": f"{p['ranks']} ranks need {p['ranks']} GPUs, and this machine has {gpus}: dimd "
                                f"refuses two ranks on one GPU"}
    result = dimd_job(["train", data.train, "--val", data.val, "--model", "resnet20", "--image-size", 32,
                       "--batch-size", p["batch_size"], "--epochs", p["epochs"], "--device", "cuda",
                       "--decode-workers", max(1, gpu_decode_workers() // p["ranks"]), "--lr", 0.1,
                       "--crop-scale", 0.35], turn.folder / "two_ranks.json", ranks=p["ranks"],
                      timeout=time_left(turn.deadline))["result"]
    graphs = result["cuda_graphs"]
    passed = bool(result["replicas_identical"]) and result["epochs_run"] == p["epochs"]
    return {"passed": passed, "images_per_s": result["images_per_s"],
            "replicas_identical": result["replicas_identical"], "allreduce": result["allreduce"],
            "time_split": result["time_split"], "cuda_graphs_rule": graphs["rule"],
            "graphs": [c["graph"] for c in graphs.get("captures", [])],
            "capture_seconds": graphs.get("capture_seconds"), "val_top1": result["val_top1"]}


# ----------------------------------------------------------------------------- nccl
#: The nccl part: bench/gpu_allreduce.py's jobs, short (the table's sizes, the one-rank runs' model and set).
NCCL = {"algorithms": "mpi,ring", "min_bytes": 1 << 20, "max_bytes": 64 << 20, "factor": 4,
        "model": "resnet20", "precision": "32-true", "image_size": 32, "batch_size": 16, "epochs": 2,
        "runs": 2, "set": "32 px"}


def nccl_jobs(costs: Costs, sets: dict[str, SetSpec]) -> list[Job]:
    p, data = NCCL, sets[NCCL["set"]]
    sizes = round(math.log(p["max_bytes"] / p["min_bytes"], p["factor"])) + 1 + 1   # and resnet50's gradients
    rows = sizes * (len(p["algorithms"].split(",")) + 2)                            # and nccl, d2h+h2d
    one_run = costs.train(images=data.epoch_images, epochs=p["epochs"], loader=DIMD_LOADER_RATES[p["image_size"]],
                          step=step_rate(p["model"], p["image_size"], p["batch_size"], graphed=True), graphs=1)
    return [Job(f"dimd bench-allreduce --device cuda: {sizes} sizes x {rows // sizes} algorithms",
                costs.allreduce_table(rows))] + [
        Job(f"dimd train {p['model']} b{p['batch_size']} one rank, {how}, run {run + 1}: {p['epochs']} epochs of "
            f"{data.images:,} images", one_run) for run in range(p["runs"]) for how in ("default", "--allreduce nccl")]


def part_nccl(turn: Turn) -> dict[str, Any]:
    """The copies' and NCCL's cost per size on one GPU, and one rank's ``--allreduce nccl`` against the default."""
    import gpu_allreduce

    p = {**NCCL, "workers": gpu_decode_workers()}
    table = gpu_allreduce.device_table(p, turn.folder, timeout=time_left(turn.deadline))
    runs = gpu_allreduce.one_rank_runs(p, turn.data[p["set"]], turn.folder, say, deadline=turn.deadline)
    rows = [{k: row[k] for k in ("bytes", "algorithm", "time_us", "busbw_gbs", "wrong")} for row in table["rows"]]
    passed = table["wrong_total"] == 0 and runs["choices"]["--allreduce nccl"]["allreduce"] == "nccl"
    return {"passed": passed, "parameters": p, "rows": rows, "gradient_bytes": table.get("gradient_bytes"), **runs}


# ----------------------------------------------------------------------------- feed
#: The feed part: bench/gpu_feed.py's grid, short: the two set-ups with a target of their own, one run each.
FEED = {"setups": [("resnet50", "32-true"), ("resnet18", "bf16-mixed")], "runs": 1, "epochs": 2,
        "ceiling_steps": 20, "decodes": ["cpu"], "loaders_alone": False, "set": "224 px"}


def feed_jobs(costs: Costs, sets: dict[str, SetSpec]) -> list[Job]:
    import gpu_feed

    p, data, jobs = {**gpu_feed.FULL, **FEED}, sets[FEED["set"]], []
    size, batch, epochs = p["image_size"], p["batch_size"], p["epochs"]
    for model, precision in p["setups"]:
        rate = step_rate(model, size, batch, precision=precision)
        jobs += [Job(f"ceiling {model} {precision}: {epochs} x {p['ceiling_steps']} steps of {batch}",
                     costs.ceiling(steps=epochs * p["ceiling_steps"], batch=batch, step=rate)),
                 Job(f"dimd train {model} {precision} b{batch}, decode cpu: {epochs} epochs of {data.images:,} images",
                     costs.train(images=data.epoch_images, epochs=epochs, step=rate, loader=DIMD_LOADER_RATES[size])),
                 Job(f"DataLoader script {model} {precision} (with torchvision): {epochs} epochs",
                     costs.dataloader(images=data.images, epochs=epochs, step=rate))]
    return jobs


def part_feed(turn: Turn) -> dict[str, Any]:
    import gpu_feed

    p = {**gpu_feed.FULL, **FEED, "workers": gpu_decode_workers(), "dataloader": gpu_feed.has_torchvision()}
    figures = gpu_feed.measure_grid(p, turn.folder, say, WORK, deadline=turn.deadline, data=turn.data[p["set"]])
    return {**figures, "parameters": {k: v for k, v in p.items() if k not in ("models", "precisions")},
            "passed": True}


PART_LIST = (Part("tests", (), tests_jobs, part_tests), Part("graphs", (GRAPHS["set"],), graphs_jobs, part_graphs),
             Part("ranks", (RANKS["set"],), ranks_jobs, part_ranks), Part("nccl", (NCCL["set"],), nccl_jobs, part_nccl),
             Part("feed", (FEED["set"],), feed_jobs, part_feed))
PART_FUNCTIONS = {part.name: part for part in PART_LIST}


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """Each step the check will take ("prepare" first, where a chosen part trains on a sample set), its jobs
    priced; a step's limit is its jobs' seconds."""

    steps: dict[str, list[Job]]
    sets: tuple[str, ...]
    budget: float

    def seconds(self, step: str) -> float:
        return sum(job.seconds for job in self.steps[step])

    @property
    def total(self) -> float:
        return sum(self.seconds(step) for step in self.steps)

    def mark(self, step: str) -> float:
        """Seconds from the check's start by which ``step`` ends: the prices of the steps up to it."""
        names = list(self.steps)
        return sum(self.seconds(name) for name in names[:names.index(step) + 1])

    def lines(self) -> list[str]:
        out = []
        for step, jobs in self.steps.items():
            out.append(f"{step}: {math.ceil(self.seconds(step))} s")
            out += [f"  {math.ceil(job.seconds):5d} s  {job.what}" for job in jobs]   # rounded up, as the total
        over = f" (over it by {math.ceil(self.total - self.budget)} s)" if self.total > self.budget else ""
        out.append(f"total {math.ceil(self.total)} s of a {self.budget:.0f} s budget{over}")
        return out

    def document(self) -> dict[str, Any]:
        return {"budget": self.budget, "total": self.total,
                "steps": {step: {"seconds": self.seconds(step), "jobs": [vars(job) for job in jobs]}
                          for step, jobs in self.steps.items()}}


def make_plan(chosen: list[str], budget: float, costs: Costs, sets: dict[str, SetSpec]) -> Plan:
    needed = tuple(dict.fromkeys(name for part in chosen for name in PART_FUNCTIONS[part].sets))
    steps: dict[str, list[Job]] = {}
    if needed:
        specs = list(dict.fromkeys(sets[name] for name in needed))
        steps["prepare"] = [Job("sample sets side by side, dimd sample-data and pack: " + "; ".join(
            f"{spec.classes} classes x ({spec.per_class} + {spec.val_per_class}) images at {spec.short_side} px"
            for spec in specs), costs.sample_sets([(spec.epoch_images, spec.large_share != 0) for spec in specs]))]
    steps.update({part: PART_FUNCTIONS[part].jobs(costs, sets) for part in chosen})
    return Plan(steps, needed, budget)


# ----------------------------------------------------------------------------- targets and table
def grid_of(parts: dict[str, Any], model: str) -> dict[str, Any]:
    """A model's step grid: from the graphs part, or from the jobs it finished before it was cut off."""
    graphs = parts.get("graphs", {})
    return graphs.get("step_grid", {}).get(model) or graphs.get("finished_jobs", {}).get(f"grid_{model}") or {}


def targets(parts: dict[str, Any], wall_s: float, gpus: int | None) -> list[dict[str, Any]]:
    """The targets, each measured (its value and whether it is met) or not measured (and why): a figure the
    check did not take never reads as met."""
    def ratio(model: str, name: str) -> float | None:
        found = grid_of(parts, model).get("ratios", {}).get(name)
        return found["median"] if found else None

    def best_sma(model: str, base: str) -> float | None:
        found = [ratio(model, f"SMA 4x16 graphed ({how}) / {base}") for how in ("branches", "streams")]
        return max((r for r in found if r is not None), default=None)

    def row(name: str, part: str, bound: tuple[str, float], value: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {"target": name, bound[0]: bound[1], "part": part}
        if value is None:
            status = parts.get(part, {}).get("status")
            why = f"the {part} part {status}" if status and status != "passed" else (
                f"the {part} part did not run" if status is None else f"not in the {part} part's figures")
            return {**out, "status": "not measured", "value": None, "met": None, "why": why}
        met = value >= bound[1] if bound[0] == "at_least" else value <= bound[1]
        return {**out, "status": "measured", "value": value, "met": met}

    train = parts.get("graphs", {}).get("train", {})
    share = train.get("runs", {}).get("S-SGD b16 graphed", {}).get("capture_share")
    nccl = parts.get("nccl", {}).get("over_default")
    rows = [row("resnet20 32 px b16: S-SGD graphed / eager (step grid)", "graphs", ("at_least", 5.0),
                ratio("resnet20", "S-SGD b16 graphed / S-SGD b16 eager")),
            row("resnet20 32 px b16: S-SGD graphed / eager (dimd train)", "graphs", ("at_least", 5.0),
                train.get("ratios", {}).get("S-SGD b16 graphed / S-SGD b16 eager")),
            row("resnet20 32 px: 4 graphed learners of 16 / S-SGD b256 eager", "graphs", ("at_least", 1.0),
                best_sma("resnet20", "S-SGD b256 eager")),
            row("resnet18 224 px: 4 graphed learners of 16 / S-SGD b128 eager", "graphs", ("at_least", 0.95),
                best_sma("resnet18", "S-SGD b128 eager")),
            row(f"captures' share of a {GRAPHS['train_epochs']}-epoch dimd train run (S-SGD b16)", "graphs",
                ("at_most", 0.05), share),
            row("one rank, resnet20 32 px b16: --allreduce nccl / default (dimd train)", "nccl", ("at_least", 0.98),
                nccl["median"] if nccl else None)]
    ranks = parts.get("ranks", {})
    across = {"target": "NCCL across ranks: the gradients' reduction between the graphs on NCCL's group, replicas "
                        "identical", "expected": "on two or more GPUs", "part": "ranks"}
    if ranks.get("status") == "passed" and ranks.get("allreduce") == "nccl":   # two ranks on two GPUs: NCCL's
        rows.append({**across, "status": "measured", "value": bool(ranks["replicas_identical"]),
                     "met": bool(ranks["replicas_identical"])})
    else:
        rows.append({**across, "status": "not measured", "value": None, "met": None,
                     "why": ("one GPU: NCCL refuses two ranks on one GPU, so the multi-rank device path needs two or "
                             "more" if (gpus or 1) < 2 else f"the ranks part {ranks.get('status', 'did not run')}, "
                             f"on {ranks.get('allreduce', 'no')} allreduce")})
    rows.append({"target": "SMA's time to accuracy / the best S-SGD's", "at_most": 0.7, "part": None,
                 "status": "not measured", "value": None, "met": None,
                 "why": "bench/sma_tta_gpu.py measures it (opt-in, about 40 minutes)"})
    rows.append({**row("make gpu-check, seconds (bench/gpu_setup.sh excluded)", "", ("at_most", TARGET_S), wall_s),
                 "part": None})
    return rows


def table(document: dict[str, Any]) -> str:
    import cuda_graphs

    result = document["result"]
    lines = [f"dimd GPU check on {result.get('gpu')} (torch {result.get('torch')}, CUDA {result.get('cuda')}): "
             f"{result['wall_seconds']:.0f} s of a {result['plan']['budget']:.0f} s budget", "",
             "| part | what | figure |", "|---|---|---|"]
    for name, part in result["parts"].items():
        lines.append(f"| {name} | status | {part['status']} in {part.get('seconds', 0):.0f} s of "
                     f"{part.get('planned_seconds', 0):.0f} s planned"
                     + (f": {part['error']}" if part.get("error") else "")
                     + (f": {part['why']}" if part.get("why") else "") + " |")
        if name == "prepare" and "records" in part:
            lines.append("| prepare | sample sets | " + ", ".join(f"{key}: {n:,} records"
                                                              for key, n in part["records"].items()) + " |")
        if name == "tests" and "tests" in part:
            lines.append(f"| tests | pytest -m cuda | {part['tests']} tests, {part['failures']} failed, "
                         f"{part['errors']} errors, {part['skipped']} skipped |")
            lines += [f"| tests | failed | {failure} |" for failure in part.get("failed", [])]
        if name == "tests" and "finished" in part:
            done = list(part["finished"].values())
            lines.append(f"| tests | finished before the cut | {len(done)} tests: " + ", ".join(
                f"{done.count(o)} {o.lower()}" for o in dict.fromkeys(done)) + " |")
        if name == "graphs":
            for row in cuda_graphs.table(part):
                where, what, figure = row.split(" | ")
                lines.append(f"| graphs | {where}: {what} | {figure} |")
        if name == "ranks" and "images_per_s" in part:
            lines.append(f"| ranks | 2 ranks on 2 GPUs, S-SGD b16 ({', '.join(part['graphs']) or 'eager'}) | "
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
        bound = (f">= {target['at_least']}" if "at_least" in target else
                 f"<= {target['at_most']}" if "at_most" in target else target["expected"])
        if target["status"] == "measured":
            verdict = f"measured {target['value']:.3g}: {'met' if target['met'] else 'NOT met'}"
        else:
            verdict = f"not measured: {target['why']}"
        lines.append(f"| target | {target['target']} ({bound}) | {verdict} |")
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
def attempt(step: Callable[[Turn], dict[str, Any]], turn: Turn, started: float) -> dict[str, Any]:
    """Run one step: its status and figures; failed or cut off, its error and the jobs it finished."""
    try:
        figures = step(turn)
        if "not_measured" in figures:   # what this machine cannot show (too few GPUs)
            return {"status": "not measured", "why": figures.pop("not_measured"), **figures}
        return {"status": "passed" if figures.pop("passed", True) else "failed", **figures}
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "error": f"past its {turn.deadline - started:.0f} s",
                "finished_jobs": finished_jobs(turn.folder, since=started)}
    except Exception as exc:   # reported, and the next step still runs
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        return {"status": "failed", "error": lines[-1][:300], "detail": "\n".join(lines[-12:]),
                "traceback": traceback.format_exc(limit=4)[-2000:],
                "finished_jobs": finished_jobs(turn.folder, since=started)}


def main(argv: list[str] | None = None, *, costs: Costs = COSTS, sets: dict[str, SetSpec] | None = None) -> int:
    """The check; ``costs`` and ``sets`` are the cost model and the sample sets (a test passes smaller ones)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the check may take")
    parser.add_argument("--plan", action="store_true", help="print the jobs and their seconds, and run nothing")
    parser.add_argument("--json", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args(argv)
    chosen = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in PARTS]
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    sets = SETS if sets is None else sets
    plan = make_plan(chosen, args.budget, costs, sets)
    if args.plan:
        print("\n".join(plan.lines()))
        return 0
    problem = no_cuda_line("bench/gpu_check.py", "checks dimd on a GPU")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from dimd.report import result_document, write_json

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    started = time.monotonic()
    folder = WORK / "runs" / "gpu_check"
    folder.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {**device_versions(), "python": sys.executable, "bin": str(BIN),
                              "plan": plan.document(), "parts": {}}

    def write() -> dict[str, Any]:
        result["wall_seconds"] = time.monotonic() - started
        result["targets"] = targets(result["parts"], result["wall_seconds"], result.get("gpus"))
        document = result_document("bench/gpu_check.py", {"parts": chosen, "budget": args.budget},
                                   {**result, "machine": machine()})
        write_json(args.json, document)
        return document

    data: dict[str, SampleSet] = {}

    def prepare(turn: Turn) -> dict[str, Any]:
        """The sample sets the chosen parts train on, built side by side (or found built) before any part
        starts; one that fails leaves the others to the parts that train on them."""
        with ThreadPoolExecutor(len(plan.sets)) as pool:
            building = {spec: pool.submit(spec.build, WORK, turn.deadline)
                        for spec in dict.fromkeys(sets[name] for name in plan.sets)}
        errors = []
        for name in plan.sets:
            try:
                data[name] = building[sets[name]].result()
            except Exception as exc:   # the first is raised below, once every set is in
                errors.append(exc)
        if errors:
            raise errors[0]
        return {"records": {name: built.records for name, built in data.items()}}

    steps = {"prepare": prepare, **{name: PART_FUNCTIONS[name].run for name in chosen}}
    for name in plan.steps:
        deadline = started + min(plan.mark(name), args.budget)   # the schedule's: unused seconds pass on
        missing = [key for key in getattr(PART_FUNCTIONS.get(name), "sets", ()) if key not in data]
        left = deadline - time.monotonic()
        if missing:
            record = {"status": "skipped", "error": f"no sample set {missing[0]} (prepare "
                                                    f"{result['parts']['prepare']['status']})"}
        elif left < plan.steps[name][0].seconds / 2:   # prices are on the slow side: half of one may do
            record = {"status": "skipped", "error": f"out of time ({left:.0f} s left)"}
        else:
            say(f"gpu-check: {name} (planned {plan.seconds(name):.0f} s, at most {left:.0f} s)")
            t0 = time.monotonic()
            record = {**attempt(steps[name], Turn(deadline, folder, data), t0), "seconds": time.monotonic() - t0}
        result["parts"][name] = {**record, "planned_seconds": plan.seconds(name)}
        write()
    document = write()
    print(table(document))
    print(f"\n{args.json} written", file=sys.stderr)
    return 0 if all(part["status"] in ("passed", "not measured") for part in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
