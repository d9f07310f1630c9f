#!/usr/bin/env python3
"""How a decoded batch reaches the GPU: what each way of getting it there costs the training process.

The decoding workers write each batch into a slot of the loader's shared ring; a copy to the GPU
runs asynchronously only from page-locked (pinned) memory. Four ways, each the real
:class:`dimd.shuffle.BatchLoader` through :class:`dimd.shuffle.device_feed.DeviceFeed`:

* ``copy``             the step's thread copies the slot into a fresh pinned tensor (torch's caching
                       host allocator), then starts its copy to the GPU and waits for it;
* ``register``         the ring is page-locked once (``cudaHostRegister``) and the GPU copies straight
                       from the slot (``borrow``): no host copy; still in the step's thread;
* ``copy, thread``     as ``copy``, in a feeding thread running two batches ahead of the step;
* ``register, thread`` both: what ``dimd train --device cuda`` does.

For each: images/s to the GPU with nothing else running, the step's thread's CPU time per batch
(what the step's Python loses), and images/s training MODEL beside it. Interleaved runs, medians;
ratios against ``copy`` within each run. Needs CUDA (else one line, exit 2).

    python bench/probes/pinned_feed.py --per-class 400 --runs 3 --json build/pinned_feed.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

#: bench/: the helpers the reproductions share (_common, gpu_feed), which this probe uses too.
BENCH = Path(__file__).resolve().parent.parent
#: way -> (batches a feeding thread stages ahead, borrow the page-locked slot)
WAYS = {"copy": (0, False), "register": (0, True), "copy, thread": (2, False), "register, thread": (2, True)}


def make_feed(way: str, store: Any, args: argparse.Namespace) -> Any:
    import torch

    from dimd.shuffle import BatchLoader
    from dimd.shuffle.device_feed import DeviceFeed

    ahead, borrow = WAYS[way]
    loader = BatchLoader(store, args.batch_size, args.image_size, decode_workers=args.workers, seed=0, pin_memory=True)
    return DeviceFeed(loader, torch.device(args.device), ahead=ahead,
                      source=lambda epoch: loader.epoch(epoch, borrow=borrow))


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def one_run(way: str, store: Any, args: argparse.Namespace, step: Any) -> dict[str, float]:
    """Epochs of ``way``'s feed (with ``step`` on each batch, or none): steady images/s and the step's
    thread's CPU per batch."""
    feed = make_feed(way, store, args)
    rates, cpu = [], []
    try:
        for epoch in range(args.epochs):
            sync(args.device)
            t0, images, main_cpu, batches = time.perf_counter(), 0, 0.0, 0
            it = feed.epoch(epoch)
            while True:
                c0 = time.thread_time()
                batch = next(it, None)
                main_cpu += time.thread_time() - c0
                if batch is None:
                    break
                if step is not None:
                    step(*batch)
                images += len(batch[0])
                batches += 1
            sync(args.device)
            rates.append(images / (time.perf_counter() - t0))
            cpu.append(main_cpu / batches)
    finally:
        feed.close()
    from _common import steady

    return {"images_per_s": steady(rates), "main_cpu_ms_per_batch": 1e3 * steady(cpu)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packed", nargs="?", help="a packed set (default: a generated sample set)")
    parser.add_argument("--per-class", type=int, default=400, help="sample set: images per class (10 classes)")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3, help="per measurement; the first is not counted")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="decoding processes (0: the cores but two)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (copy and thread only)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench/probes/pinned_feed.py measures on a GPU: this machine has no CUDA device "
              f"(torch {torch.__version__})", file=sys.stderr)
        return 2
    sys.path.insert(1, str(BENCH))
    from _common import gpu_decode_workers, sample_set, spread
    from gpu_feed import device_versions, model_and_step

    from dimd.mpi import init_mpi
    from dimd.report import result_document, write_json
    from dimd.shuffle import DistributedStore

    args.workers = args.workers or gpu_decode_workers()
    packed = args.packed or str(sample_set(10, args.per_class, 20, log=print).train)
    init_mpi("funneled")
    from mpi4py import MPI

    store = DistributedStore.load(packed, MPI.COMM_WORLD)
    step = model_and_step(args.model, 10, args.precision)[1] if args.device == "cuda" else None
    ways = list(WAYS) if args.device == "cuda" else ["copy", "copy, thread"]
    figures: dict[str, dict[str, list[float]]] = {}
    for run in range(args.runs):
        for way in ways:
            besides = [("alone", None)] + ([(f"training {args.model} {args.precision}", step)] if step else [])
            for beside, train_step in besides:
                result = one_run(way, store, args, train_step)
                print(f"run {run + 1} {way:16s} {beside}: {result['images_per_s']:8.0f} images/s, main thread "
                      f"{result['main_cpu_ms_per_batch']:.2f} ms/batch", flush=True)
                for key, value in result.items():
                    figures.setdefault(f"{way}|{beside}|{key}", []).append(value)
    summary: dict[str, Any] = {key: spread(values) for key, values in figures.items()}
    for key in list(figures):
        way, rest = key.split("|", 1)
        if way != "copy" and rest.endswith("images_per_s"):
            summary[f"{way} / copy|{rest}"] = spread(a / b for a, b in zip(figures[key], figures[f"copy|{rest}"]))
    for key, value in summary.items():
        print(f"{key:60s} {value['median']:10.2f}  ({value['min']:.2f}-{value['max']:.2f})")
    if args.json:
        versions = device_versions() if args.device == "cuda" else {}
        write_json(args.json, result_document("bench/probes/pinned_feed.py", {**vars(args), "json": str(args.json)},
                                              {"figures": summary, "records": len(store), **versions}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
