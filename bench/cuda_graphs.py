#!/usr/bin/env python3
"""CUDA graphs on one GPU: images/s of dimd's own steps, eager against graphed, at small batches.

    python bench/cuda_graphs.py            # the grid below, medians of 3 runs; needs CUDA (about 6 minutes)
    python bench/cuda_graphs.py --quick    # a smoke test of the pipeline (one short run)

Without a CUDA device it prints one line and exits 2. Two parts, one rank, 32-true, SGD with momentum:

* **the step grid**: dimd's strategies (``SSGD``, ``SMA``; graphed: ``GraphedSSGD``, ``GraphedSMA``) stepping on
  fixed batches already on the GPU, as ``dimd train`` steps them (the per-step read of the figures and, for
  eager steps, the engine's synchronisation for its time split included), in one process per model:

  - resnet20 at 32 px: S-SGD at batch 16, SMA with K = 2 and 4 learners of batch 16 (graphed as one graph of
    K branches, and at K = 4 also as K graphs on K streams), S-SGD at batch 256; each eager and graphed;
  - resnet18 at 224 px: S-SGD at batch 16, SMA with K = 4 learners of batch 16, S-SGD at batch 128.

  Each timing runs steps for about ``--seconds``; set-ups are interleaved over ``--runs`` runs and every ratio
  is taken within a run (medians and spreads over the runs);
* **dimd train** on a 32-px sample set (resnet20, batch 16 per learner): S-SGD eager and graphed, SMA with 4
  graphed learners, S-SGD at batch 256 eager; images/s of the epochs after the first, and what the captures
  cost (their seconds against the run's).

The JSON (cuda_graphs.json in the results folder) names the GPU and the versions; the figure joins the gallery
(bench/reproduce.py, opt-in). One model's grid alone: ``python bench/cuda_graphs.py --job grid --model resnet20
--image-size 32 --setups ssgd:16:eager,ssgd:16:graphed --json PATH``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from _common import (Context, JobError, Reproduction, SampleSet, dimd_job, gpu_decode_workers, no_cuda_line,
                     python_job, sample_set, spread, steady, time_left)

SCRIPT = "bench/cuda_graphs.py"

#: One set-up of the step grid: ``SYNC:BATCH[xK]:HOW`` (HOW: eager, graphed for S-SGD; eager, branches, loop for SMA).
RESNET20_SETUPS = ("ssgd:16:eager", "ssgd:16:graphed", "sma:16x2:eager", "sma:16x2:branches", "sma:16x4:eager",
                   "sma:16x4:branches", "sma:16x4:loop", "ssgd:256:eager", "ssgd:256:graphed")
RESNET18_SETUPS = ("ssgd:16:eager", "ssgd:16:graphed", "sma:16x4:eager", "sma:16x4:branches", "sma:16x4:loop",
                   "ssgd:128:eager", "ssgd:128:graphed")
#: dimd train's set-ups on the 32-px set: (name, extra options).
TRAIN_SETUPS = (("S-SGD b16 eager", ["--batch-size", 16, "--no-cuda-graphs"]),
                ("S-SGD b16 graphed", ["--batch-size", 16, "--cuda-graphs"]),
                ("SMA 4x16 graphed", ["--batch-size", 16, "--sync", "sma", "--learners", 4, "--cuda-graphs"]),
                ("S-SGD b256 eager", ["--batch-size", 256, "--no-cuda-graphs"]))

FULL = {"models": {"resnet20": (32, RESNET20_SETUPS), "resnet18": (224, RESNET18_SETUPS)}, "runs": 3,
        "seconds": 2.0, "train_setups": [name for name, _ in TRAIN_SETUPS], "train_epochs": 3, "classes": 10,
        "per_class": 1000, "val_per_class": 20, "short_side": 36}
QUICK = {"models": {"resnet20": (32, ("ssgd:16:eager", "ssgd:16:graphed", "sma:16x2:branches"))}, "runs": 1,
         "seconds": 0.3, "train_setups": ["S-SGD b16 eager", "S-SGD b16 graphed"], "train_epochs": 2,
         "per_class": 60}


# ----------------------------------------------------------------------------- the step grid (one process)
@dataclass(frozen=True)
class Setup:
    """``ssgd:16:graphed`` -> S-SGD at batch 16, graphed; ``sma:16x4:loop`` -> SMA, 4 learners of 16, K graphs."""

    sync: str
    batch: int
    learners: int
    how: str

    @classmethod
    def parse(cls, text: str) -> "Setup":
        sync, size, how = text.split(":")
        batch, _, k = size.partition("x")
        return cls(sync, int(batch), int(k or 1), how)

    @property
    def graphed(self) -> bool:
        return self.how != "eager"

    @property
    def name(self) -> str:
        if self.sync == "ssgd":
            return f"S-SGD b{self.batch} {self.how}"
        how = {"branches": "graphed (branches)", "loop": "graphed (streams)"}.get(self.how, self.how)
        return f"SMA {self.learners}x{self.batch} {how}"

    @property
    def images(self) -> int:
        return self.batch * self.learners

    @property
    def eager_twin(self) -> str:
        return Setup(self.sync, self.batch, self.learners, "eager").name

    @property
    def graphs(self) -> int:
        """The graphs its strategy captures on one rank: S-SGD's step; SMA's learners (one graph of branches, or
        one graph per learner), their update and the synchronisation."""
        if not self.graphed:
            return 0
        return 1 if self.sync == "ssgd" else (1 if self.how == "branches" else self.learners) + 2


def build_setup(setup: Setup, model_name: str, image_size: int, device: Any) -> tuple[Callable[[], Any], Any]:
    """One set-up's step on fixed batches on ``device`` (a function), and its strategy."""
    import torch

    from dimd.shuffle.normalize import Normalize
    from dimd.train.graphed_sgd import GraphedSSGD
    from dimd.train.graphed_sma import GraphedSMA
    from dimd.train.models import build_model
    from dimd.train.precision import memory_format
    from dimd.train.sgd import SSGD, make_optimizer
    from dimd.train.sma import SMA
    from dimd.train.steps import StepPlace

    torch.manual_seed(0)
    model = build_model(model_name, 10)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else None   # SMA's, as the engine passes it
    strategy: Any
    if setup.sync == "ssgd":
        layout = memory_format(None, device, model)                           # channels-last on CUDA, as dimd train
        model.to(device, memory_format=layout)
        optimizer = make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-4)
        kind = GraphedSSGD if setup.graphed else SSGD
        strategy = kind(model, optimizer, lambda array: None, 1, normalize=Normalize(device, layout))
    else:
        model.to(device)
        options = dict(learners=setup.learners, alpha=None, momentum=0.9, central_momentum=None, weight_decay=1e-4,
                       normalize=Normalize(device), synchronize=synchronize)
        strategy = (GraphedSMA(model, lambda array: None, 1, compute=setup.how, **options) if setup.graphed
                    else SMA(model, lambda array: None, 1, compute="loop", **options))
    generator = torch.Generator(device=device).manual_seed(1)
    batches = [(torch.randint(0, 256, (setup.batch, 3, image_size, image_size), dtype=torch.uint8, device=device,
                              generator=generator),
                torch.randint(0, 10, (setup.batch,), device=device, generator=generator))
               for _ in range(setup.learners)]

    def step() -> Any:
        return strategy.step(batches, StepPlace(lr=0.01))

    return step, strategy


#: The fewest steps a timing takes, however short its ``--seconds``.
AT_LEAST_STEPS = 5


def images_per_s(step: Callable[[], Any], images: int, seconds: float, device: Any,
                 at_least: int = AT_LEAST_STEPS) -> float:
    """Steps for about ``seconds`` (at least ``at_least``): images per second, the device's queue drained."""
    import torch

    drain = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    drain()
    t0, steps = time.perf_counter(), 0
    while steps < at_least or time.perf_counter() - t0 < seconds:
        step()
        steps += 1
    drain()
    return steps * images / (time.perf_counter() - t0)


def grid_job(args: argparse.Namespace) -> dict[str, Any]:
    """One model's step grid, interleaved over ``args.runs`` runs. Off a GPU the graphed strategies run on the
    CPU stand-in (a smoke test of this script; its figures mean nothing)."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setups = [Setup.parse(text) for text in args.setups.split(",")]
    steps, strategies = {}, {}
    for setup in setups:
        steps[setup.name], strategies[setup.name] = build_setup(setup, args.model, args.image_size, device)
        warm = 0
        while warm < 3 or (setup.graphed and strategies[setup.name].graphs.warming_up()):   # warm-up, captures
            steps[setup.name]()
            warm += 1
    rates: dict[str, list[float]] = {setup.name: [] for setup in setups}
    for _ in range(args.runs):   # interleaved: the machine's drift hits every set-up alike
        for setup in setups:
            rates[setup.name].append(images_per_s(steps[setup.name], setup.images, args.seconds, device))
    captures = {name: strategy.figures()["cuda_graphs"] for name, strategy in strategies.items()
                if "cuda_graphs" in strategy.figures()}
    return {"device": str(device), **grid_figures(setups, rates, captures),
            "max_memory_allocated": torch.cuda.max_memory_allocated() if device.type == "cuda" else None}


def grid_figures(setups: list[Setup], rates: dict[str, list[float]],
                 captures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A grid's figures from each set-up's images/s per run and its graphs' records: the spreads, the ratios
    taken within a run (graphed over its eager twin, SMA's graphed learners over the largest eager S-SGD batch,
    K graphs on K streams over one graph of K branches), and what the captures cost."""
    ratios = {}
    for setup in setups:
        twin = setup.eager_twin
        if setup.graphed and twin in rates:
            ratios[f"{setup.name} / {twin}"] = spread(g / e for g, e in zip(rates[setup.name], rates[twin]))
    largest = max((s for s in setups if s.sync == "ssgd" and not s.graphed), key=lambda s: s.batch, default=None)
    for setup in setups:
        if setup.sync == "sma" and setup.graphed and largest is not None and largest.batch > setup.batch:
            ratios[f"{setup.name} / {largest.name}"] = spread(
                g / e for g, e in zip(rates[setup.name], rates[largest.name]))
    streams, branches = (next((s.name for s in setups if s.sync == "sma" and s.how == how and s.learners == k), None)
                         for how, k in (("loop", 4), ("branches", 4)))
    if streams and branches:
        ratios[f"{streams} / {branches}"] = spread(a / b for a, b in zip(rates[streams], rates[branches]))
    return {"images_per_s": {name: spread(v) for name, v in rates.items()}, "ratios": ratios,
            "captures": {name: {"capture_seconds": c["capture_seconds"], "pool_bytes": c["pool_bytes"],
                                "captures": len(c["captures"])} for name, c in captures.items()}}


def device_versions() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None, "torch": torch.__version__}
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}


def job_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="One model's step grid of bench/cuda_graphs.py")
    parser.add_argument("--job", choices=["grid"], required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--setups", default=",".join(RESNET20_SETUPS))
    parser.add_argument("--runs", type=int, default=FULL["runs"])
    parser.add_argument("--seconds", type=float, default=FULL["seconds"])
    args = parser.parse_args(argv)
    from dimd.report import result_document, write_json

    write_json(Path(args.json), result_document("bench/cuda_graphs.py", vars(args),
                                                {**grid_job(args), **device_versions()}))
    return 0


# ----------------------------------------------------------------------------- the measurement
def step_grids(p: dict[str, Any], folder: Path, log: Callable[[str], None], *,
               deadline: float | None = None) -> dict[str, Any]:
    """Every model's step grid, each in a process of its own."""
    grids = {}
    for model, (size, setups) in p["models"].items():
        log(f"step grid: {model} at {size} px, {len(setups)} set-ups x {p['runs']} run(s)")
        grids[model] = python_job(Path(__file__), ["--job", "grid", "--model", model, "--image-size", size,
                                                   "--setups", ",".join(setups), "--runs", p["runs"],
                                                   "--seconds", p["seconds"]],
                                  folder / f"grid_{model}.json", "bench/cuda_graphs.py",
                                  timeout=time_left(deadline))["result"]
        grids[model]["image_size"] = size
    return grids


def train_runs(p: dict[str, Any], folder: Path, log: Callable[[str], None], work: Path, workers: int, *,
               deadline: float | None = None, data: SampleSet | None = None) -> dict[str, Any]:
    """dimd train's set-ups on a 32-px sample set: ``data``, or one made from ``p`` (packed at a short side of
    ``short_side``)."""
    data = data or sample_set(p["classes"], p["per_class"], p["val_per_class"], log=log,
                              short_side=p["short_side"], work=work)
    chosen = dict(TRAIN_SETUPS)
    runs: dict[str, Any] = {}
    for name in p["train_setups"]:
        log(f"dimd train: resnet20, {name}")
        doc = dimd_job(["train", data.train, "--val", data.val, "--model", "resnet20", "--image-size", 32,
                        "--epochs", p["train_epochs"], "--device", "cuda", "--decode-workers", workers,
                        "--lr", 0.1, "--schedule", "constant", "--crop-scale", 0.35, *chosen[name]],
                       folder / f"train_{name.replace(' ', '_')}.json", timeout=time_left(deadline))
        result = doc["result"]
        graphs = result["cuda_graphs"]
        runs[name] = {"images_per_s": steady([e["images_per_s"] for e in result["history"]]),
                      "seconds": result["seconds"], "cuda_graphs": graphs,
                      "capture_share": graphs.get("capture_seconds", 0.0) / result["seconds"]}
    ratios = {}
    for a, b in (("S-SGD b16 graphed", "S-SGD b16 eager"), ("SMA 4x16 graphed", "S-SGD b256 eager"),
                 ("SMA 4x16 graphed", "S-SGD b16 graphed")):
        if a in runs and b in runs:
            ratios[f"{a} / {b}"] = runs[a]["images_per_s"] / runs[b]["images_per_s"]
    return {"records": data.records, "runs": runs, "ratios": ratios}


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    problem = no_cuda_line(SCRIPT)
    if problem:
        raise JobError(problem)
    p = ctx.size(FULL, QUICK)
    return p, {"step_grid": step_grids(p, ctx.folder(), ctx.log),
               "train": train_runs(p, ctx.folder(), ctx.log, ctx.work, gpu_decode_workers()), **device_versions()}


def table(figures: dict[str, Any]) -> list[str]:
    """The figures as table rows (also bench/gpu_check.py's)."""
    rows = []
    for model, grid in figures.get("step_grid", {}).items():
        for name, rate in grid["images_per_s"].items():
            rows.append(f"{model} {grid['image_size']} px | {name} | {rate['median']:,.0f} img/s")
        for name, ratio in grid["ratios"].items():
            rows.append(f"{model} {grid['image_size']} px | {name} | {ratio['median']:.2f}x")
    train = figures.get("train", {})
    for name, run in train.get("runs", {}).items():
        share = f", captures {100 * run['capture_share']:.2f}% of the run" if run["cuda_graphs"]["on"] else ""
        rows.append(f"dimd train resnet20 32 px | {name} | {run['images_per_s']:,.0f} img/s{share}")
    for name, ratio in train.get("ratios", {}).items():
        rows.append(f"dimd train resnet20 32 px | {name} | {ratio:.2f}x")
    return rows


def plot(envelope: dict[str, Any]) -> Any:
    from dimd import plotting

    grids = envelope["result"]["step_grid"]
    fig, axes = plotting.figure(1, len(grids), width=5.4, height=4.4)
    for ax, (model, grid) in zip(axes[0], grids.items()):
        names = list(grid["images_per_s"])
        for i, name in enumerate(names):
            plotting.bars(ax, [i], [grid["images_per_s"][name]], width=0.7, label=None,
                          color_=plotting.color("eager" if name.endswith("eager") else "graphed", 0))
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("training images/s (one GPU, fixed batches)")
        ax.set_title(f"{model} at {grid['image_size']} px")
    return fig


def findings(envelope: dict[str, Any]) -> str:
    result = envelope["result"]
    lines = [f"On {result['gpu']} (torch {result['torch']}, CUDA {result.get('cuda')}), one rank, 32-true, medians "
             f"of {envelope['parameters']['runs']} interleaved run(s); ratios within a run:"]
    lines += [f"- {row}" for row in table(result)]
    return "\n".join(lines)


REPRODUCTION = Reproduction(
    name="cuda_graphs",
    title="CUDA graphs: small batches at GPU speed, S-SGD's step and Crossbow's learners",
    claim=("At a small batch per GPU a step is hundreds of kernels launched one by one from Python, and the launches "
           "set the pace. Captured once as a CUDA graph and replayed, S-SGD's step at batch 16 ran 6.7x eager "
           "(resnet20, 32 px, H100), and four graphed learners of batch 16 matched one replica at batch 256: "
           "Crossbow's small-batch learners at large-batch speed."),
    measure=measure, plot=plot, findings=findings, minutes=6.0, default=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--job" in argv:
        return job_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test of the pipeline, not a result")
    parser.parse_args(argv)
    import reproduce

    return reproduce.measure_on_gpu(REPRODUCTION, "--quick" in argv, no_cuda_line(SCRIPT))

if __name__ == "__main__":
    sys.exit(main())
