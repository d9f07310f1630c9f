#!/usr/bin/env python3
"""dimd on one GPU: training images/s against the GPU's ceiling and against a plain DataLoader script.

    python bench/gpu_feed.py            # everything below, medians of 3 (make gpu-feed); needs CUDA
    python bench/gpu_feed.py --quick    # a smoke test of the pipeline (one small run)

Without a CUDA device it prints one line and exits 2. For each model (resnet50, resnet18) at 224 px,
batch 128, in 32-true and bf16-mixed (channels-last on both), one rank:

* ``ceiling``      the model trained on one fixed batch already on the GPU (no loading at all);
* ``dimd``         ``dimd train --device cuda`` with ``--decode cpu`` and, where torchvision is
                   installed, ``--decode gpu`` (nvJPEG);
* ``DataLoader``   what a PyTorch user writes: torchvision's ``ImageFolder`` over the packed records
                   written out one file each (the same JPEG bytes), ``DataLoader(num_workers,
                   pin_memory=True, persistent_workers=True)``, random-resized crop + flip as uint8,
                   normalised on the GPU, the same model, optimizer and precision;

and each loader alone (no step; the batches copied to the GPU). A run's figure is the median of its
epochs after the first (start-up and warm-up). Runs are interleaved; ratios are taken within a run,
then their median over the runs. The JSON (gpu_feed.json in the results folder) names the GPU and the torch,
CUDA and torchvision versions; the figure joins the gallery (bench/reproduce.py, opt-in).

One measurement alone: ``python bench/gpu_feed.py --job ceiling|dataloader|loader --json PATH ...``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from _common import (Context, JobError, Reproduction, SampleSet, dimd_job, gpu_decode_workers, no_cuda_line,
                     python_job, sample_set, spread, steady, time_left)

SCRIPT = "bench/gpu_feed.py"

FULL = {"models": ["resnet50", "resnet18"], "precisions": ["32-true", "bf16-mixed"], "image_size": 224,
        "batch_size": 128, "epochs": 3, "runs": 3, "classes": 10, "per_class": 800, "val_per_class": 20,
        "ceiling_steps": 40}
QUICK = {"models": ["resnet18"], "per_class": 40, "epochs": 2, "runs": 1, "ceiling_steps": 5}
TRAINERS = ("ceiling", "dimd, decode cpu", "dimd, decode gpu", "DataLoader")
LOADERS = ("dimd, decode cpu", "dimd, decode gpu", "DataLoader")


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def device_versions() -> dict[str, Any]:
    import torch

    versions = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version()}
    if has_torchvision():
        import torchvision

        versions["torchvision"] = torchvision.__version__
    return versions


# ----------------------------------------------------------------------------- the single jobs
def model_and_step(name: str, classes: int, precision: str) -> tuple[Any, Any]:
    """The model on the GPU (channels-last) and one training step on a uint8 batch, as dimd trains."""
    import torch
    import torch.nn.functional as F

    from dimd.shuffle.normalize import Normalize
    from dimd.train.models import build_model
    from dimd.train.precision import Precision, memory_format
    from dimd.train.sgd import make_optimizer

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(name, classes)
    layout = memory_format(None, device, model)
    model.to(device, memory_format=layout)
    optimizer = make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-4)
    mode, normalize = Precision(precision, device), Normalize(device, layout)
    scaler = torch.amp.GradScaler("cuda") if precision == "16-mixed" else None

    def step(images: Any, labels: Any) -> None:
        with mode.autocast():
            loss = F.cross_entropy(model(normalize(images)), labels.to(device, non_blocking=True))
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    return model, step


def ceiling_job(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    _, step = model_and_step(args.model, args.classes, args.precision)
    images = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size), dtype=torch.uint8,
                           device="cuda")
    labels = torch.randint(0, args.classes, (args.batch_size,), device="cuda")
    rates = []
    for _ in range(args.epochs):          # "epochs" of ceiling_steps steps: the first is the warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(images, labels)
        torch.cuda.synchronize()
        rates.append(args.steps * args.batch_size / (time.perf_counter() - t0))
    return {"images_per_s": rates}


def imagefolder_loader(args: argparse.Namespace) -> Any:
    import torch
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.RandomResizedCrop(args.image_size, antialias=True),
                                    transforms.RandomHorizontalFlip(), transforms.PILToTensor()])
    folder = datasets.ImageFolder(args.files, transform=transform)
    return torch.utils.data.DataLoader(folder, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                       num_workers=args.workers, pin_memory=True, persistent_workers=True)


def dataloader_job(args: argparse.Namespace) -> dict[str, Any]:
    """The baseline training script; with ``--alone``, its loader only (batches copied to the GPU)."""
    import torch

    loader = imagefolder_loader(args)
    step = None if args.alone else model_and_step(args.model, len(loader.dataset.classes), args.precision)[1]
    rates, waits = [], []
    for _ in range(args.epochs):
        torch.cuda.synchronize()
        t0, waited, images = time.perf_counter(), 0.0, 0
        batches = iter(loader)
        while True:
            w0 = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - w0
            if batch is None:
                break
            pixels = batch[0].to("cuda", non_blocking=True)
            labels = batch[1].to("cuda", non_blocking=True)
            if step is not None:
                step(pixels, labels)
            images += len(labels)
        torch.cuda.synchronize()
        rates.append(images / (time.perf_counter() - t0))
        waits.append(waited)
    return {"images_per_s": rates, "data_seconds": waits}


def dimd_loader_job(args: argparse.Namespace) -> dict[str, Any]:
    """dimd's loader alone on one rank, through the device feed (``--decode`` cpu or gpu), as dimd train feeds."""
    import torch

    from dimd.mpi import init_mpi
    from dimd.shuffle import BatchLoader, DistributedStore
    from dimd.shuffle.device_feed import device_feed

    init_mpi("funneled")
    from mpi4py import MPI

    device = torch.device("cuda")
    store = DistributedStore.load(args.packed, MPI.COMM_WORLD)
    feed = device_feed(BatchLoader(store, args.batch_size, args.image_size, decode_workers=args.workers, seed=0,
                                   pin_memory=True), device, args.decode)
    rates = []
    try:
        for epoch in range(args.epochs):
            torch.cuda.synchronize()
            t0, images = time.perf_counter(), 0
            for pixels, _ in feed.epoch(epoch):
                images += len(pixels)
            torch.cuda.synchronize()
            rates.append(images / (time.perf_counter() - t0))
    finally:
        feed.close()
    return {"images_per_s": rates}


JOBS = {"ceiling": ceiling_job, "dataloader": dataloader_job, "loader": dimd_loader_job}


def job_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="One measurement of bench/gpu_feed.py")
    parser.add_argument("--job", choices=JOBS, required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=FULL["image_size"])
    parser.add_argument("--batch-size", type=int, default=FULL["batch_size"])
    parser.add_argument("--epochs", type=int, default=FULL["epochs"])
    parser.add_argument("--steps", type=int, default=FULL["ceiling_steps"])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--files", help="the records as files, one class folder each (DataLoader)")
    parser.add_argument("--packed", help="the packed set (dimd's loader)")
    parser.add_argument("--decode", default="cpu")
    parser.add_argument("--alone", action="store_true", help="DataLoader: the loader without a step")
    args = parser.parse_args(argv)
    from dimd.report import result_document, write_json

    figures = {**JOBS[args.job](args), **device_versions()}
    write_json(Path(args.json), result_document("bench/gpu_feed.py", vars(args), figures))
    return 0


# ----------------------------------------------------------------------------- the reproduction
def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    problem = no_cuda_line(SCRIPT)
    if problem:
        raise JobError(problem)
    p = {**ctx.size(FULL, QUICK), "workers": gpu_decode_workers()}
    p["decodes"] = ["cpu", "gpu"] if has_torchvision() else ["cpu"]
    return p, {**measure_grid(p, ctx.folder(), ctx.log, ctx.work), **device_versions()}


def measure_grid(p: dict[str, Any], folder: Path, log: Any, work: Path, *,
                 deadline: float | None = None, data: SampleSet | None = None) -> dict[str, Any]:
    """The grid of ``p`` on ``data`` (or a set made from ``p``): ``setups`` (model, precision) pairs, or every
    model in every precision; with ``dataloader`` False no DataLoader runs, with ``loaders_alone`` False no
    loader-alone runs. ``deadline`` (time.monotonic()): no job runs past it (bench/gpu_check.py's short grid)."""
    data = data or sample_set(p["classes"], p["per_class"], p["val_per_class"], log=log, work=work)
    common = ["--image-size", p["image_size"], "--batch-size", p["batch_size"], "--epochs", p["epochs"]]
    pairs = p.get("setups") or [(model, precision) for model in p["models"] for precision in p["precisions"]]
    trained: dict[str, list[float]] = {}
    alone: dict[str, list[float]] = {}

    def job(kind: str, name: str, *args: Any) -> list[float]:
        path = folder / f"{name.replace(' ', '_').replace(',', '')}_run{run}.json"
        return python_job(Path(__file__), ["--job", kind, *common, *args], path, "bench/gpu_feed.py",
                          timeout=time_left(deadline))["result"]["images_per_s"]

    for run in range(p["runs"]):           # interleaved: the machine's drift hits every set-up alike
        for model, precision in pairs:
            key = f"{model} {precision}"
            log(f"run {run + 1}/{p['runs']}: {key}")
            trained.setdefault(f"{key}|ceiling", []).append(steady(job(
                "ceiling", f"ceiling {key}", "--model", model, "--precision", precision,
                "--classes", p["classes"], "--steps", p["ceiling_steps"])))
            for decode in p["decodes"]:
                path = folder / f"dimd_{model}_{precision}_{decode}_run{run}.json"
                doc = dimd_job(["train", data.train, "--val", data.val, "--model", model, "--precision",
                                precision, "--decode", decode, "--device", "cuda", "--decode-workers",
                                p["workers"], "--lr", 0.1, "--schedule", "constant", *common], path,
                               timeout=time_left(deadline))
                history = doc["result"]["history"]
                trained.setdefault(f"{key}|dimd, decode {decode}", []).append(
                    steady([e["images_per_s"] for e in history]))
            if p.get("dataloader", True):
                trained.setdefault(f"{key}|DataLoader", []).append(steady(job(
                    "dataloader", f"dataloader {key}", "--model", model, "--precision", precision,
                    "--files", data.files, "--workers", p["workers"])))
        if not p.get("loaders_alone", True):
            continue
        for decode in p["decodes"]:
            alone.setdefault(f"dimd, decode {decode}", []).append(steady(job(
                "loader", f"loader {decode}", "--packed", data.train, "--decode", decode,
                "--workers", p["workers"])))
        alone.setdefault("DataLoader", []).append(steady(job(
            "dataloader", "dataloader alone", "--alone", "--files", data.files, "--workers", p["workers"])))

    setups = {}
    for key in dict.fromkeys(k.split("|")[0] for k in trained):
        runs = {setup: trained[f"{key}|{setup}"] for setup in TRAINERS if f"{key}|{setup}" in trained}
        ratios = {}
        for setup, values in runs.items():
            for base in ("ceiling", "DataLoader"):
                if setup != base and base in runs:
                    ratios[f"{setup} / {base}"] = spread(v / b for v, b in zip(values, runs[base]))
        setups[key] = {"images_per_s": {s: spread(v) for s, v in runs.items()}, "ratios": ratios}
    return {"setups": setups, "loaders_alone": {s: spread(v) for s, v in alone.items()}, "records": data.records}


def plot(envelope: dict[str, Any]) -> Any:
    from dimd import plotting

    result = envelope["result"]
    fig, axes = plotting.figure(1, 2, width=6.0, height=4.6, gridspec_kw={"width_ratios": [3, 1]})
    ax, ax_alone = axes[0]
    keys = list(result["setups"])
    present = [s for s in TRAINERS if any(s in result["setups"][k]["images_per_s"] for k in keys)]
    width = 0.8 / len(present)
    for i, setup in enumerate(present):
        spreads = [result["setups"][k]["images_per_s"].get(setup, {}) for k in keys]
        plotting.bars(ax, [j + (i - (len(present) - 1) / 2) * width for j in range(len(keys))], spreads,
                      width=width, label=setup, color_=plotting.color(setup, i))
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylabel("training images/s (one GPU)")
    ax.legend(fontsize=8)
    loaders = list(result["loaders_alone"])
    plotting.bars(ax_alone, list(range(len(loaders))), [result["loaders_alone"][k] for k in loaders], width=0.6,
                  label=None, color_=plotting.color("loader", 0))
    ax_alone.set_xticks(range(len(loaders)), loaders, rotation=20, fontsize=8)
    ax_alone.set_ylabel("images/s, loader alone (to the GPU)")
    return fig


def findings(envelope: dict[str, Any]) -> str:
    result = envelope["result"]
    lines = [f"On {result['gpu']} (torch {result['torch']}, CUDA {result['cuda']}"
             + (f", torchvision {result['torchvision']}" if "torchvision" in result else "")
             + f"), {result['records']} records, batch {envelope['parameters']['batch_size']}, one rank, "
             + f"{envelope['parameters']['runs']} run(s), {envelope['parameters']['epochs']} epochs each (the first "
             "not counted); medians of the runs, ratios taken within a run:"]
    for key, figures in result["setups"].items():
        rates = ", ".join(f"{s} {v['median']:,.0f}" for s, v in figures["images_per_s"].items())
        ratios = "; ".join(f"{r} {v['median']:.2f}x" for r, v in figures["ratios"].items() if r.startswith("dimd"))
        lines.append(f"- **{key}**: {rates} img/s" + (f"; {ratios}." if ratios else "."))
    alone = ", ".join(f"{s} {v['median']:,.0f}" for s, v in result["loaders_alone"].items())
    lines.append(f"- Loaders alone: {alone} img/s.")
    return "\n".join(lines)


REPRODUCTION = Reproduction(
    name="gpu_feed",
    title="dimd on one GPU: training images/s against the ceiling and a DataLoader script",
    claim="A GPU trains only as fast as it is fed: the ceiling is the model on a fixed batch already on the "
          "device. A plain DataLoader with worker processes reaches 0.78-0.91x of it at 32-true on an H100; "
          "dimd should reach at least 0.95x (resnet50) and feed bf16-mixed resnet18 at least 2x the DataLoader.",
    measure=measure, plot=plot, findings=findings, minutes=25.0, default=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--job" in argv:
        return job_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test of the pipeline, not a result")
    parser.add_argument("--models", help=f"comma-separated (default {','.join(FULL['models'])})")
    parser.add_argument("--precisions", help=f"comma-separated (default {','.join(FULL['precisions'])})")
    for name in ("runs", "epochs", "per_class"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {FULL[name]}")
    args = parser.parse_args(argv)
    for name in ("models", "precisions"):       # a part of the full measurement (a GPU lent for minutes)
        if getattr(args, name):
            FULL[name] = getattr(args, name).split(",")
    FULL.update({name: getattr(args, name) for name in ("runs", "epochs", "per_class") if getattr(args, name)})
    import reproduce

    return reproduce.measure_on_gpu(REPRODUCTION, args.quick, no_cuda_line(SCRIPT))

if __name__ == "__main__":
    sys.exit(main())
