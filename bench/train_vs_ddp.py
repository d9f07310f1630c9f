#!/usr/bin/env python
"""dimd train against PyTorch DistributedDataParallel (gloo), and in-memory data against files.

Three set-ups, the same model, per-rank batch, augmentation, optimizer and P ranks:

* ``dimd``       ``mpiexec -n P dimd train PACKED`` (in-memory store, flat-buffer allreduce);
* ``dimd-files`` the same, but ``--read-from files``: every image read from its original file;
* ``ddp``        ``torch.nn.parallel.DistributedDataParallel`` over gloo with a
                 ``DataLoader`` (``DistributedSampler``, ``--workers`` worker processes)
                 over the original image tree: what a PyTorch user would run instead.

Each set-up runs ``--repeats`` times; a run's figure is the median over its
epochs after the first (warm-up). Prints a table and writes ``--json``.

    .venv/bin/python bench/train_vs_ddp.py demo/images/train demo/train demo/val \\
        --model resnet20 --image-size 32 --batch-size 32 --epochs 4 --repeats 3 --json bench/train_vs_ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


# ----------------------------------------------------------------------------- the DDP baseline
class ImageTree:
    """torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip, as uint8 CHW tensors."""

    def __init__(self, files: list, image_size: int) -> None:
        self.files, self.image_size = files, image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import numpy as np
        import torch
        from PIL import Image

        from dimd.shuffle.decode import random_resized_crop_box

        path, label = self.files[i]
        rng = np.random.default_rng()
        with Image.open(path) as image:
            image = image.convert("RGB")
            x, y, w, h = random_resized_crop_box(image.width, image.height, rng)
            crop = image.resize((self.image_size,) * 2, Image.BILINEAR, box=(x, y, x + w, y + h))
        array = np.asarray(crop)
        if rng.random() < 0.5:
            array = array[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))), label


def ddp_worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from dimd.train.models import build_model
    from dimd.train.schedule import scaled_lr
    from dimd.train.sgd import Normalize, make_optimizer

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.np)
    root = Path(args.tree)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = [(p, label) for label, c in enumerate(classes) for p in sorted((root / c).iterdir())]

    sampler = DistributedSampler(ImageTree(files, args.image_size), num_replicas=args.np, rank=rank, shuffle=True,
                                 seed=0, drop_last=True)
    loader = DataLoader(ImageTree(files, args.image_size), batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.workers, persistent_workers=True, prefetch_factor=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(args.model, len(classes)))
    lr = scaled_lr(args.lr, args.batch_size * args.np)
    optimizer = make_optimizer(model.module, lr=lr, momentum=0.9, weight_decay=1e-4)
    normalize = Normalize(torch.device("cpu"))
    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        images_done, start = 0, time.perf_counter()
        for images, labels in loader:
            loss = F.cross_entropy(model(normalize(images)), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            images_done += len(labels) * args.np
        seconds = time.perf_counter() - start
        epochs.append({"epoch": epoch + 1, "seconds": seconds, "images": images_done,
                       "images_per_s": images_done / seconds})
    if rank == 0:
        Path(out).write_text(json.dumps({"history": epochs}))
    dist.destroy_process_group()


def run_ddp(args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        mp.spawn(ddp_worker, args=(args, port, out), nprocs=args.np, join=True)
        return json.loads(Path(out).read_text())["history"]


# ----------------------------------------------------------------------------- dimd train
def run_dimd(args: argparse.Namespace, read_from: str) -> tuple[list[dict], dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "train.json"
        command = [str(BIN / "mpiexec"), "-n", str(args.np), str(BIN / "dimd"), "train", args.packed,
                   "--val", args.val, "--model", args.model, "--image-size", str(args.image_size),
                   "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                   "--schedule", "constant", "--workers", str(args.workers), "--threads", str(args.threads),
                   "--read-from", read_from, "--files-root", args.tree, "--json", str(out)]
        if args.allreduce:
            command += ["--allreduce", args.allreduce]
        proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr}")
        envelope = json.loads(out.read_text())
        doc = {**envelope["result"], "mpi": envelope["mpi"]}
    history = [{"epoch": e["epoch"], "seconds": e["train_seconds"], "images": e["images"],
                "images_per_s": e["images_per_s"], "time_split": e["time_split"]} for e in doc["history"]]
    return history, {"allreduce": doc["allreduce"], "mpi": doc.get("mpi")}


def steady(history: list[dict], key: str) -> float:
    """Median over the epochs after the first (start-up, caches, thread pools)."""
    values = [e[key] for e in history[1:]] or [e[key] for e in history]
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", help="the original image tree (class folders), as packed")
    parser.add_argument("packed", help="the packed training set (dimd pack output of TREE)")
    parser.add_argument("val", help="a packed validation set (dimd train needs one; not timed)")
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.4)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="decoding threads (dimd) / DataLoader workers (DDP)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank, the same for all")
    parser.add_argument("--allreduce", default=None, help="dimd's algorithm [default: chosen at start-up]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setups", default="dimd,dimd-files,ddp")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    setups = args.setups.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in setups}
    extra: dict = {}
    for repeat in range(args.repeats):
        for setup in setups:          # interleaved, so machine noise hits every set-up alike
            if setup == "ddp":
                history = run_ddp(args)
            else:
                history, extra = run_dimd(args, "files" if setup == "dimd-files" else "memory")
            runs[setup].append({"images_per_s": steady(history, "images_per_s"),
                                "epoch_seconds": steady(history, "seconds"), "history": history})
            print(f"repeat {repeat + 1}/{args.repeats} {setup:<11} {runs[setup][-1]['images_per_s']:8.1f} img/s "
                  f"{runs[setup][-1]['epoch_seconds']:6.2f} s/epoch", flush=True)

    summary = {}
    for setup, results in runs.items():
        ips = [r["images_per_s"] for r in results]
        eps = [r["epoch_seconds"] for r in results]
        summary[setup] = {"images_per_s_median": statistics.median(ips), "images_per_s_min": min(ips),
                          "images_per_s_max": max(ips), "epoch_seconds_median": statistics.median(eps),
                          "epoch_seconds_min": min(eps), "epoch_seconds_max": max(eps)}
    print(f"\n{'set-up':<12}{'img/s median':>14}{'(min-max)':>18}{'s/epoch median':>16}")
    for setup, s in summary.items():
        print(f"{setup:<12}{s['images_per_s_median']:>14.1f}{s['images_per_s_min']:>9.1f}-{s['images_per_s_max']:<8.1f}"
              f"{s['epoch_seconds_median']:>16.2f}")
    ratios = {}
    if "dimd" in summary and "ddp" in summary:
        ratios["dimd_vs_ddp_images_per_s"] = summary["dimd"]["images_per_s_median"] / summary["ddp"]["images_per_s_median"]
    if "dimd" in summary and "dimd-files" in summary:
        ratios["in_memory_epoch_time_saving"] = 1 - summary["dimd"]["epoch_seconds_median"] / summary["dimd-files"]["epoch_seconds_median"]
    # Paired per repeat (the set-ups of one repeat ran back to back): robust to the machine's drift.
    paired = {}
    if "dimd" in runs and "ddp" in runs:
        paired["dimd_vs_ddp_images_per_s"] = [a["images_per_s"] / b["images_per_s"]
                                              for a, b in zip(runs["dimd"], runs["ddp"])]
    if "dimd" in runs and "dimd-files" in runs:
        paired["in_memory_epoch_time_saving"] = [1 - a["epoch_seconds"] / b["epoch_seconds"]
                                                 for a, b in zip(runs["dimd"], runs["dimd-files"])]
    for name, value in ratios.items():
        per_repeat = paired.get(name, [])
        print(f"{name}: {value:.3f} (ratio of medians); per repeat "
              f"{', '.join(f'{v:.3f}' for v in per_repeat)}; median {statistics.median(per_repeat):.3f}")
    if args.json:
        doc = {"command": "bench/train_vs_ddp.py", "parameters": vars(args), "summary": summary,
               "ratios": ratios, "paired_ratios": paired, "runs": runs, **extra, "host": socket.gethostname(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
