#!/usr/bin/env python3
"""dimd train against PyTorch DistributedDataParallel: training images/s and where the time goes.

Three set-ups, the same model, per-rank batch, augmentation, optimizer, P ranks and threads:

* ``dimd``         ``mpiexec -n P dimd train PACKED`` (in-memory store, flat-buffer allreduce);
* ``dimd (files)`` the same with ``--read-from files``: every image read from its file;
* ``DDP``          ``torch.nn.parallel.DistributedDataParallel`` over gloo, fed by a
                   ``DataLoader`` (``DistributedSampler``, ``workers`` worker processes) over
                   the same files, decoded by dimd's one DataLoader baseline
                   (``dimd.shuffle.bench_io.FileDataset``): what a PyTorch user runs instead;
* ``DistributedGradients``  the DDP loop and data with ``dimd.DistributedGradients`` in DDP's place,
                   under mpiexec, reducing its buckets with the ``torch`` algorithm on a gloo
                   group started as DDP's is: dimd's gradient mechanism against DDP's reducer on the
                   same collective, nothing else changed.

The files hold the packed records' bytes, so all three decode the same JPEGs.
A run's figure is the median over its epochs after the first (the warm-up).

The DDP baseline also runs alone:

    .venv/bin/python bench/train_vs_ddp.py --packed STEM --files DIR --np 2 --json ddp.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import BENCH, BIN, Context, Reproduction, dimd_job, json_job, python_job, read_result, sample_set, spread

FULL = {"model": "resnet20", "image_size": 32, "batch_size": 32, "epochs": 4, "lr": 0.4, "ranks": 2,
        "workers": 2, "threads": 1, "runs": 3, "classes": 10, "per_class": 64, "val_per_class": 2}
QUICK = {"epochs": 2, "per_class": 16}
SETUPS = ("dimd", "dimd (files)", "DDP", "DistributedGradients")
SPLIT = ("data", "compute", "allreduce", "optimizer")


# ----------------------------------------------------------------------------- the baselines
def file_batches(args: argparse.Namespace, rank: int) -> tuple[Any, Any, int]:
    """The DataLoader over the files (DistributedSampler, worker processes), its sampler, the class count."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from dimd.format import PackedDataset
    from dimd.shuffle.bench_io import FileDataset

    packed = PackedDataset(args.packed)
    files = FileDataset([Path(args.files) / name for name in packed.names], np.asarray(packed.labels),
                        args.image_size, seed=args.seed)
    sampler = DistributedSampler(files, num_replicas=args.np, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    loader = DataLoader(files, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.workers, persistent_workers=True, prefetch_factor=2,
                        generator=torch.Generator().manual_seed(args.seed + rank))
    return loader, sampler, len(packed.classes)


def train_epochs(model: Any, optimizer: Any, loader: Any, sampler: Any, args: argparse.Namespace) -> list[dict]:
    """The user's plain loop; ``compute`` holds forward and backward (with whatever allreduce overlaps it),
    ``optimizer`` the step (with whatever allreduce it waits for)."""
    import torch
    import torch.nn.functional as F

    from dimd.shuffle.normalize import Normalize

    normalize = Normalize(torch.device("cpu"))
    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        split = dict.fromkeys(SPLIT, 0.0)
        images, start, cpu = 0, time.perf_counter(), time.process_time()
        batches = iter(loader)
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            inputs, labels = batch
            loss = F.cross_entropy(model(normalize(inputs)), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()               # DDP's and DistributedGradients' allreduce run meanwhile
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            split["data"] += t1 - t0
            split["compute"] += t2 - t1
            split["optimizer"] += t3 - t2
            images += len(labels) * args.np
        seconds = time.perf_counter() - start
        # the rank process's CPU time, all its threads (the reducer's, gloo's): what the mechanism costs, whatever
        # else the machine runs (its DataLoader workers are processes of their own)
        history.append({"epoch": epoch + 1, "train_seconds": seconds, "images": images,
                        "cpu_ms_per_image": 1e3 * (time.process_time() - cpu) / (images / args.np),
                        "images_per_s": images / seconds, "time_split": split})
    return history


def ddp_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dimd.train.models import build_model
    from dimd.train.schedule import scaled_lr
    from dimd.train.sgd import make_optimizer

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.np)
    loader, sampler, classes = file_batches(args, rank)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(build_model(args.model, classes))
    optimizer = make_optimizer(model.module, lr=scaled_lr(args.lr, args.batch_size * args.np), momentum=0.9,
                               weight_decay=1e-4)
    history = train_epochs(model, optimizer, loader, sampler, args)
    if rank == 0:
        from dimd.report import result_document, write_json

        write_json(args.json, result_document("bench/train_vs_ddp.py", vars(args),
                                              {"history": history, "world_size": args.np}))
    dist.destroy_process_group()


def library_main(args: argparse.Namespace) -> None:
    """The DDP loop with dimd.DistributedGradients in DDP's place, under mpiexec, on the same gloo collective."""
    import torch

    import dimd
    from dimd.allreduce import start_group
    from dimd.train.models import build_model
    from dimd.train.schedule import scaled_lr
    from dimd.train.sgd import make_optimizer

    comm, _ = dimd.init(device="cpu", threads=args.threads)
    rank = comm.Get_rank()
    group = start_group(comm, "gloo")   # the default group, as DDP's script starts it; `torch` reduces on it
    loader, sampler, classes = file_batches(args, rank)
    torch.manual_seed(args.seed)
    model = build_model(args.model, classes)
    optimizer = make_optimizer(model, lr=scaled_lr(args.lr, args.batch_size * args.np), momentum=0.9,
                               weight_decay=1e-4)
    grads = dimd.DistributedGradients(model, comm, algorithm=args.algorithm, optimizer=optimizer)
    history = train_epochs(model, optimizer, loader, sampler, args)
    grads.close()
    group.close()
    if rank == 0:
        from dimd.report import result_document, write_json

        write_json(args.json, result_document("bench/train_vs_ddp.py", vars(args),
                                              {"history": history, "world_size": args.np}))


def ddp_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The DDP baseline: " + __doc__.splitlines()[0])
    parser.add_argument("--packed", required=True, help="the packed set (for the record names and labels)")
    parser.add_argument("--files", required=True, help="the folder holding each record as a file")
    for name, default in (("model", FULL["model"]), ("image-size", FULL["image_size"]),
                          ("batch-size", FULL["batch_size"]), ("epochs", FULL["epochs"]), ("lr", FULL["lr"]),
                          ("np", FULL["ranks"]), ("workers", FULL["workers"]), ("threads", FULL["threads"]),
                          ("seed", 0)):
        parser.add_argument(f"--{name}", type=type(default), default=default)
    parser.add_argument("--library", metavar="ALGORITHM",
                        help="run under mpiexec with dimd.DistributedGradients (this allreduce) instead of DDP")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if args.library:
        args.algorithm = args.library
        return library_main(args)

    import torch.multiprocessing as mp

    from dimd.host import free_port

    mp.spawn(ddp_worker, args=(args, free_port("127.0.0.1")), nprocs=args.np, join=True)


# ----------------------------------------------------------------------------- the reproduction
def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    p = ctx.size(FULL, QUICK)
    data = sample_set(p["classes"], p["per_class"], p["val_per_class"], log=ctx.log)
    runs: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for run in range(p["runs"]):
        for setup in SETUPS:            # interleaved, so machine noise hits every set-up alike
            ctx.log(f"run {run + 1}/{p['runs']}: {setup}")
            path = ctx.folder() / f"{setup.replace(' ', '_').strip('()')}_run{run}.json"
            baseline = ["--packed", data.train, "--files", data.files, "--model", p["model"],
                        "--image-size", p["image_size"], "--batch-size", p["batch_size"], "--epochs", p["epochs"],
                        "--lr", p["lr"], "--np", p["ranks"], "--workers", p["workers"], "--threads", p["threads"]]
            if setup == "DDP":
                doc = python_job(BENCH / "train_vs_ddp.py", baseline, path, "bench/train_vs_ddp.py")
            elif setup == "DistributedGradients":   # DDP's loop and gloo collective, dimd's buckets and thread
                json_job([BIN / "mpiexec", "-n", p["ranks"], sys.executable, BENCH / "train_vs_ddp.py", *baseline,
                          "--library", "torch"], path)
                doc = read_result(path, "bench/train_vs_ddp.py")
            else:
                doc = dimd_job(["train", data.train, "--val", data.val, "--model", p["model"],
                                "--image-size", p["image_size"], "--batch-size", p["batch_size"],
                                "--epochs", p["epochs"], "--lr", p["lr"], "--schedule", "constant",
                                "--decode-workers", p["workers"], "--threads", p["threads"],
                                *(["--read-from", "files", "--files-root", data.files] if "files" in setup
                                  else [])], path, ranks=p["ranks"])
            runs[setup].append(steady(doc["result"]["history"]))
    summary = {setup: {"images_per_s": spread(r["images_per_s"] for r in results),
                       "epoch_seconds": spread(r["train_seconds"] for r in results),
                       "time_split": {k: spread(r["time_split"].get(k, 0.0) for r in results) for k in SPLIT}}
               for setup, results in runs.items()}
    paired = [a["images_per_s"] / b["images_per_s"] for a, b in zip(runs["dimd"], runs["DDP"])]
    library = [a["images_per_s"] / b["images_per_s"] for a, b in zip(runs["DistributedGradients"], runs["DDP"])]
    cpu = [a["cpu_ms_per_image"] / b["cpu_ms_per_image"] for a, b in zip(runs["DistributedGradients"], runs["DDP"])]
    return p, {"records": data.records, "setups": summary, "dimd_over_ddp_per_run": spread(paired),
               "distributed_gradients_over_ddp_per_run": spread(library),
               "distributed_gradients_over_ddp_cpu_per_image": spread(cpu)}


def steady(history: list[dict]) -> dict[str, Any]:
    """Median over the epochs after the first (start-up, caches, thread pools) of each figure."""
    epochs = history[1:] or history
    return {"images_per_s": statistics.median(e["images_per_s"] for e in epochs),
            "train_seconds": statistics.median(e["train_seconds"] for e in epochs),
            "cpu_ms_per_image": statistics.median(e.get("cpu_ms_per_image", float("nan")) for e in epochs),
            "time_split": {k: statistics.median(e["time_split"].get(k, 0.0) for e in epochs) for k in SPLIT}}


def plot(envelope: dict[str, Any]):
    from dimd import plotting

    setups = envelope["result"]["setups"]
    names = list(setups)
    colours = {"dimd": plotting.color("dimd"), "dimd (files)": "#ff9896", "DDP": plotting.color("ddp"),
               "DistributedGradients": "#c5b0d5"}
    fig, axes = plotting.figure(1, 2, width=4.8, height=4.0)
    ax, split_ax = axes[0]
    for i, name in enumerate(names):
        plotting.bars(ax, [i], [setups[name]["images_per_s"]], width=0.6, label=None, color_=colours[name])
    plotting.baseline_level(ax, setups["DDP"]["images_per_s"], "PyTorch DDP (the baseline)")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("training images/s (all ranks)")
    ax.set_title("throughput, epochs after the first")
    ax.legend(loc="lower right", fontsize=7)
    bottom = [0.0] * len(names)
    part_colours = {"data": "#1f77b4", "compute": "#2ca02c", "allreduce": "#d62728", "optimizer": "#9467bd"}
    for part in SPLIT:
        values = [setups[n]["time_split"][part]["median"] for n in names]
        label = part if part != "compute" else "compute (DDP: + its overlapped allreduce)"
        split_ax.bar(range(len(names)), values, bottom=bottom, width=0.6, label=label, color=part_colours[part])
        bottom = [b + v for b, v in zip(bottom, values)]
    split_ax.set_xticks(range(len(names)), names)
    split_ax.set_ylabel("seconds per epoch and rank (medians)")
    split_ax.set_title("where an epoch's time goes")
    split_ax.set_ylim(top=max(bottom) * 1.4)   # room above the bars for the legend
    split_ax.legend(fontsize=7, loc="upper center", ncol=2)
    return fig


def findings(envelope: dict[str, Any]) -> str:
    result, p = envelope["result"], envelope["parameters"]
    s = result["setups"]

    def cell(name: str) -> str:
        r = s[name]["images_per_s"]
        return f"{name} {r['median']:.0f} images/s ({r['min']:.0f}-{r['max']:.0f})"

    ratio = result["dimd_over_ddp_per_run"]
    split = s["dimd"]["time_split"]
    ddp = s["DDP"]["time_split"]
    return (f"{p['model']} at {p['image_size']} px, batch {p['batch_size']} per rank, P = {p['ranks']}, "
            f"{p['workers']} decoding workers and {p['threads']} torch thread per rank, {result['records']} "
            f"images, {p['epochs']} epochs, medians of {p['runs']} runs: " + ", ".join(cell(n) for n in s)
            + f". dimd / DDP per run: {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}). Per "
            f"epoch and rank dimd waits {split['data']['median']:.2f} s for data and spends "
            f"{split['allreduce']['median']:.2f} s in the allreduce; DDP waits {ddp['data']['median']:.2f} s for "
            f"its DataLoader (worker processes, not threads: they compete with the compute for the 2 cores)."
            + library_finding(result))


def library_finding(result: dict[str, Any]) -> str:
    """DDP against the same loop with dimd.DistributedGradients on the same gloo collective (newer runs only)."""
    ratio = result.get("distributed_gradients_over_ddp_per_run")
    if ratio is None:
        return ""
    cpu = result.get("distributed_gradients_over_ddp_cpu_per_image")
    return (f" The same DataLoader loop with dimd.DistributedGradients in DDP's place (the `torch` algorithm on "
            f"the same gloo group, each bucket started from the hook that completes it): {ratio['median']:.2f}x "
            f"DDP's images/s ({ratio['min']:.2f}-{ratio['max']:.2f})"
            + (f", {cpu['median']:.2f}x its CPU time per image ({cpu['min']:.2f}-{cpu['max']:.2f})" if cpu else "")
            + ".")


REPRODUCTION = Reproduction(
    name="train_vs_ddp",
    title="dimd train against PyTorch DDP: images/s and the time split",
    claim=("(Not a figure of the papers: what a user of this field would run instead.) DIMD's in-memory "
           "data and tuned allreduce should train faster than the stock PyTorch pipeline, a DataLoader over "
           "image files feeding DistributedDataParallel."),
    measure=measure, plot=plot, findings=findings, minutes=1.0)


if __name__ == "__main__":
    ddp_main(sys.argv[1:])
