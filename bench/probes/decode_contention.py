#!/usr/bin/env python3
"""How much the loader slows the training step it feeds, and how fast it decodes meanwhile.

Times forward + backward + optimizer of MODEL at batch B (one torch thread, a
fixed synthetic batch, as `dimd plan-batch step-time` does) alone and beside
something decoding the packed set's records flat out, then alone again;
medians of ``--repeats`` x ``--steps``. What runs beside it, per measurement:

* ``none``: nothing (the step alone);
* ``threads:K``: K threads in this process calling dimd's ``decode_train`` in a
  loop (the old loader's mechanism: decoding threads inside the training process);
* ``loader:K``: the real :class:`dimd.shuffle.BatchLoader` with ``workers=K``,
  its batches consumed as fast as they come by a thread of this process.

and ``--loader-only`` times the loader alone (no step): images/s, images
per CPU-second (this process plus its decoding workers) and the training
process's own CPU time per batch (the hand-over). Run it under the
``PYTHONPATH`` of another tree to measure that tree's loader the same way
(how the old thread loader was compared with the worker processes).

    .venv/bin/python bench/probes/decode_contention.py bench/work/data/sample/train --model lenet \\
        --image-size 32 --beside none,threads:1,loader:1,none --json build/decode_contention.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable


def process_cpu_seconds(pids: list[int]) -> float:
    """user + system seconds of this process (all threads) and of ``pids`` (its decoding workers)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2])
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
        except OSError:
            pass
    return total


def memory(pid: int | str) -> dict[str, int]:
    """Rss and Pss (the shared pages divided among the processes that map them) of ``pid``, in bytes."""
    figures = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("Rss", "Pss"):
                    figures[key.lower()] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return figures


class Beside:
    """Something decoding flat out next to the step: ``start()``, then ``stop()`` -> images decoded."""

    def __init__(self, spec: str, records: list[bytes], store: Any, args: argparse.Namespace) -> None:
        self.kind, _, count = spec.partition(":")
        self.count = int(count or 0)
        self.records, self.store, self.args = records, store, args
        self.decoded = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.loader: Any = None
        if self.kind == "loader":
            from dimd.shuffle import BatchLoader

            self.loader = BatchLoader(store, args.loader_batch, args.image_size, train=True, decode_workers=self.count,
                                      seed=0, crop_scale=args.crop_scale)
            for _ in zip(range(2), self.loader.epoch(0)):   # start the workers, outside the timing
                pass

    def start(self) -> None:
        self._stop.clear()
        self.decoded = 0
        target: Callable[[int], None] = self._decode if self.kind == "threads" else self._consume
        n = self.count if self.kind == "threads" else (1 if self.kind == "loader" else 0)
        self._threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> int:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return self.decoded

    def _decode(self, seed: int) -> None:
        import numpy as np

        from dimd.shuffle.decode import decode_train

        rng = np.random.default_rng(seed)
        while not self._stop.is_set():
            decode_train(self.records[int(rng.integers(len(self.records)))], self.args.image_size, rng,
                         (self.args.crop_scale, 1.0))
            self.decoded += 1

    def _consume(self, _: int) -> None:
        epoch = 1
        while not self._stop.is_set():
            for images, _labels in self.loader.epoch(epoch):
                self.decoded += len(images)
                if self._stop.is_set():
                    break
            epoch += 1

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()


def loader_rate(store: Any, args: argparse.Namespace, workers: int) -> dict[str, float]:
    """The loader alone: images/s and images per CPU-second over ``--loader-images`` images."""
    from dimd.shuffle import BatchLoader

    with BatchLoader(store, args.loader_batch, args.image_size, train=True, decode_workers=workers, seed=0,
                     crop_scale=args.crop_scale) as loader:
        for _ in zip(range(2), loader.epoch(0)):
            pass
        pids = list(getattr(loader, "worker_pids", []))
        images, batches, epoch = 0, 0, 1
        cpu0, rank0, wall0 = process_cpu_seconds(pids), time.thread_time(), time.perf_counter()
        while images < args.loader_images:
            for batch, _labels in loader.epoch(epoch):
                images, batches = images + len(batch), batches + 1
                if images >= args.loader_images:
                    break
            epoch += 1
        wall, cpu = time.perf_counter() - wall0, process_cpu_seconds(pids) - cpu0
        rank_ms = (time.thread_time() - rank0) / batches * 1e3   # the hand-over, in the training process
        startup = getattr(loader, "startup_seconds", None)
        rank, workers = memory("self"), [memory(pid) for pid in pids]
    return {"images": images, "images_per_s": images / wall, "images_per_cpu_s": images / cpu,
            "rank_cpu_ms_per_batch": rank_ms,
            "worker_startup_s": startup, "store_bytes": store.nbytes,
            "rank_rss": rank.get("rss"), "rank_pss": rank.get("pss"),
            "workers_rss": sum(w.get("rss", 0) for w in workers), "workers_pss": sum(w.get("pss", 0) for w in workers),
            "pss_total": rank.get("pss", 0) + sum(w.get("pss", 0) for w in workers)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packed", help="a packed training set (its records are decoded alongside)")
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16, help="the step's batch")
    parser.add_argument("--loader-batch", type=int, default=16, help="the loader's batch")
    parser.add_argument("--crop-scale", type=float, default=0.35)
    parser.add_argument("--beside", default="none,threads:1,loader:1,none",
                        help="what decodes beside the step, per measurement, in order")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loader-only", default="", help="comma-separated worker counts: time the loader alone")
    parser.add_argument("--loader-images", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from dimd.format import PackedDataset
    from dimd.mpi import init_mpi
    from dimd.report import result_document, spread, write_json
    from dimd.shuffle import DistributedStore
    from dimd.shuffle.normalize import Normalize
    from dimd.train.models import build_model
    from dimd.train.sgd import make_optimizer

    init_mpi("funneled")
    from mpi4py import MPI

    torch.set_num_threads(1)
    data = PackedDataset(args.packed)
    records = [bytes(data.record(i)) for i in range(len(data))]
    store = DistributedStore.load(args.packed, MPI.COMM_WORLD)
    rows: list[dict[str, Any]] = []
    for workers in (int(k) for k in args.loader_only.split(",") if k):
        rate = loader_rate(store, args, workers)
        rows.append({"beside": f"loader-only:{workers}", **rate})
        print(f"loader alone, {workers} worker(s): {rate['images_per_s']:,.0f} images/s, "
              f"{rate['images_per_cpu_s']:,.0f} images per CPU-second, {rate['rank_cpu_ms_per_batch']:.2f} ms "
              f"of the rank's CPU per batch; rank + workers Pss "
              f"{rate['pss_total'] / 2**20:.0f} MiB (rank Rss {rate['rank_rss'] / 2**20:.0f} MiB, "
              f"workers Rss {rate['workers_rss'] / 2**20:.0f} MiB, store {rate['store_bytes'] / 2**20:.1f} MiB); "
              f"workers started in {rate['worker_startup_s'] or 0:.2f} s", flush=True)

    model = build_model(args.model, len(data.classes))
    optimizer = make_optimizer(model, lr=0.01, momentum=0.9, weight_decay=5e-4)
    normalize = Normalize(torch.device("cpu"))
    size = args.image_size
    images = torch.randint(0, 256, (args.batch_size, 3, size, size), dtype=torch.uint8)
    labels = torch.randint(0, len(data.classes), (args.batch_size,))

    def step_ms(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(model(normalize(images)), labels).backward()
            optimizer.step()
        return (time.perf_counter() - start) / steps * 1e3

    step_ms(max(args.steps // 4, 5))   # warm-up
    for spec in (s for s in args.beside.split(",") if s):
        beside = Beside(spec, records, store, args)
        beside.start()
        started = time.perf_counter()
        times = [step_ms(args.steps) for _ in range(args.repeats)]
        rate = beside.stop() / (time.perf_counter() - started)
        beside.close()
        rows.append({"beside": spec, "step_ms": spread(times), "decoded_per_s": round(rate, 1)})
        print(f"beside {spec}: step {statistics.median(times):.3f} ms (min {min(times):.3f}, max {max(times):.3f}); "
              f"{rate:,.0f} images decoded/s alongside", flush=True)
    alone = [r["step_ms"]["median"] for r in rows if r["beside"] == "none"]
    for row in rows:
        if "step_ms" in row and alone:
            row["step_over_alone"] = round(row["step_ms"]["median"] / statistics.median(alone), 3)
    print(f"load: {os.getloadavg()}", file=sys.stderr)
    if args.json:
        write_json(args.json, result_document("bench/probes/decode_contention.py",
                                              vars(args) | {"json": str(args.json)},
                                              {"rows": rows, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
