#!/usr/bin/env python3
"""What a host allreduce costs a GPU rank, and what NCCL costs instead: the device checks, in one go.

    python bench/gpu_allreduce.py            # about 10 minutes on one GPU; needs CUDA
    python bench/gpu_allreduce.py --quick    # a smoke test of the pipeline (about 3 minutes)

Without a CUDA device it prints one line and exits 2. On one GPU, one rank:

* ``bench-allreduce --device cuda``: per size (1 MiB to 256 MiB, and resnet50's gradients), NCCL's
  allreduce in device memory, the copy to pinned host memory and back alone (``d2h+h2d``: what one
  rank pays on the host path, with nothing to sum), and the host algorithms with those copies;
* ``dimd train --device cuda`` one rank, today's way (the default: one rank sums nothing and skips
  the reduction) against ``--allreduce nccl`` (the group started from MPI, its buckets on the device),
  runs interleaved, images/s the median of each run's epochs after the first. The target: nccl at
  least 0.98x the default.

The JSON (gpu_allreduce.json in the results folder) names the GPU, torch, CUDA and NCCL; the figure
joins the gallery (bench/reproduce.py, opt-in). The tests that need a GPU are
``pytest -m cuda tests/test_cuda.py`` (among them a one-rank NCCL run and this table's command).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from _common import (JOB_TIMEOUT_S, Context, JobError, Reproduction, dimd_job, gpu_decode_workers, no_cuda_line,
                     sample_set, spread, steady, time_left)

FULL = {"model": "resnet50", "precision": "bf16-mixed", "image_size": 224, "batch_size": 128, "epochs": 3,
        "runs": 3, "classes": 10, "per_class": 300, "val_per_class": 10, "min_bytes": 1 << 20,
        "max_bytes": 256 << 20, "factor": 4, "algorithms": "mpi,ring,multicolor"}
QUICK = {"model": "resnet18", "per_class": 40, "epochs": 2, "runs": 1, "max_bytes": 16 << 20}
SCRIPT = "bench/gpu_allreduce.py"
#: The one-rank run as it was (one rank skips the reduction), and the one that starts the device group.
DEFAULT = "default (one rank skips the reduction)"


def device_versions() -> dict[str, Any]:
    import torch

    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def device_table(p: dict[str, Any], folder: Path, *, timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    """``dimd bench-allreduce --device cuda`` on one rank over ``p``'s sizes and algorithms (and resnet50's
    gradient size), checked: NCCL in device memory, the copies alone, each host algorithm with them."""
    return dimd_job(["bench-allreduce", "--device", "cuda", "-a", p["algorithms"], "-b", p["min_bytes"],
                     "-e", p["max_bytes"], "-f", p["factor"], "--model", "resnet50", "--check"],
                    folder / "bench_allreduce_cuda.json", ranks=1, timeout=timeout)["result"]


def one_rank_runs(p: dict[str, Any], data: Any, folder: Path, log: Callable[[str], None], *,
                  device: str = "cuda", backend: str = "nccl", deadline: float | None = None) -> dict[str, Any]:
    """``dimd train`` on one rank, the default against ``--allreduce BACKEND``, ``p["runs"]`` times interleaved
    (the machine's drift hits both alike): each run's steady images/s, their spreads, the ratio's spread, and
    what each run's JSON says it chose. ``deadline`` (time.monotonic()): no run goes past it."""
    setups = {DEFAULT: [], f"--allreduce {backend}": ["--allreduce", backend]}
    runs: dict[str, list[float]] = {setup: [] for setup in setups}
    choices: dict[str, Any] = {}
    for run in range(p["runs"]):
        for setup, extra in setups.items():
            log(f"run {run + 1}/{p['runs']}: {setup}")
            doc = dimd_job(["train", data.train, "--val", data.val, "--model", p["model"], "--precision",
                            p["precision"], "--device", device, "--decode-workers", p["workers"],
                            "--image-size", p["image_size"], "--batch-size", p["batch_size"], "--epochs",
                            p["epochs"], "--lr", 0.1, "--schedule", "constant", *extra],
                           folder / f"train_{backend if extra else 'default'}_run{run}.json", ranks=1,
                           timeout=time_left(deadline))
            result = doc["result"]
            runs[setup].append(steady([e["images_per_s"] for e in result["history"]]))
            choices[setup] = {"allreduce": result["allreduce"], "how": result["allreduce_choice"]["how"],
                              "cuda_graphs": result["cuda_graphs"]["rule"]}
    default, named = runs.values()
    return {"train": {setup: spread(rates) for setup, rates in runs.items()}, "choices": choices,
            "over_default": spread(n / d for n, d in zip(named, default))}


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    problem = no_cuda_line(SCRIPT)
    if problem:
        raise JobError(problem)
    p = {**ctx.size(FULL, QUICK), "workers": gpu_decode_workers()}
    ctx.log("bench-allreduce --device cuda, one rank")
    table = device_table(p, ctx.folder())
    data = sample_set(p["classes"], p["per_class"], p["val_per_class"], log=ctx.log)
    runs = one_rank_runs(p, data, ctx.folder(), ctx.log)
    figures = {"table": table, "train": runs["train"], "choices": runs["choices"],
               "nccl_over_default": runs["over_default"], "records": data.records, **device_versions()}
    return p, figures


def plot(envelope: dict[str, Any]) -> Any:
    from dimd import plotting

    result = envelope["result"]
    fig, axes = plotting.figure(1, 2, width=6.4, height=4.2, gridspec_kw={"width_ratios": [3, 1]})
    ax, ax_train = axes[0]
    rows = result["table"]["rows"]
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        mine = sorted((r["bytes"], r["time_us"] / 1000) for r in rows if r["algorithm"] == name and r["bytes"])
        ax.plot([b / 2**20 for b, _ in mine], [t for _, t in mine], marker="o", label=name,
                color=plotting.color(name, i), linestyle="--" if name == "d2h+h2d" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message (MiB), device buffers")
    ax.set_ylabel("time per allreduce (ms), one rank")
    ax.set_title("what a GPU rank pays")
    ax.legend(fontsize=7)
    setups = list(result["train"])
    plotting.bars(ax_train, list(range(len(setups))), [result["train"][s] for s in setups], width=0.6,
                  label=None, color_=plotting.color("dimd", 0))
    ax_train.set_xticks(range(len(setups)), ["default", "nccl"])
    ax_train.set_ylabel("training images/s, one GPU")
    return fig


def findings(envelope: dict[str, Any]) -> str:
    result, p = envelope["result"], envelope["parameters"]
    rows = result["table"]["rows"]
    copies = sorted((r["bytes"], r["time_us"]) for r in rows if r["algorithm"] == "d2h+h2d" and r["bytes"])
    biggest = copies[-1] if copies else (0, 0.0)
    gradient = result["table"].get("gradient_bytes")
    at_gradient = next((t for b, t in copies if b == gradient), None)
    train = result["train"]
    ratio = result["nccl_over_default"]
    return (f"On {result['gpu']} (torch {result['torch']}, CUDA {result['cuda']}, NCCL {result['nccl']}), one "
            f"rank. The copy to the host and back alone takes {biggest[1] / 1000:.2f} ms for "
            f"{biggest[0] / 2**20:.0f} MiB"
            + (f" and {at_gradient / 1000:.2f} ms for resnet50's {gradient / 2**20:.1f} MiB of gradients"
               if at_gradient is not None else "")
            + f". {p['model']} {p['precision']} at batch {p['batch_size']}, {p['runs']} run(s) of {p['epochs']} "
            f"epochs (the first not counted): "
            + ", ".join(f"{s} {v['median']:,.0f} images/s" for s, v in train.items())
            + f"; nccl / default {ratio['median']:.3f}x ({ratio['min']:.3f}-{ratio['max']:.3f}; target at "
              f"least 0.98x).")


REPRODUCTION = Reproduction(
    name="gpu_allreduce",
    title="What a host allreduce costs a GPU rank: the copies, and NCCL instead",
    claim=("(DIMD's figure 5 with a modern row.) A GPU rank that sums its gradients on the host pays a copy "
           "to the host and back on top of the host algorithm; NCCL sums them in device memory. On one GPU "
           "the table shows the copies' cost per size, and dimd train with `--allreduce nccl` should train "
           "at least 0.98x as fast as the one-rank run that skips the reduction."),
    measure=measure, plot=plot, findings=findings, minutes=10.0, default=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test of the pipeline, not a result")
    for name in ("runs", "epochs", "per_class"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {FULL[name]}")
    parser.add_argument("--model", help=f"default {FULL['model']}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    FULL.update({name: getattr(args, name) for name in ("runs", "epochs", "per_class", "model")
                 if getattr(args, name)})
    import reproduce

    return reproduce.measure_on_gpu(REPRODUCTION, args.quick, no_cuda_line(SCRIPT))


if __name__ == "__main__":
    sys.exit(main())
