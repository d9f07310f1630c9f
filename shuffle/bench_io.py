"""``dimd bench-io``: the in-memory loader against what a PyTorch user would do, and the decode limit.

Three measurements of training batches (random-resized crop + flip, uint8
N x 3 x S x S) on the same images, augmentation and worker count:

* ``dimd``: :class:`BatchLoader` over the packed records in memory (worker processes,
  DCT-domain draft decoding);
* ``torch``: a ``torch.utils.data.DataLoader`` (worker processes) over the
  original image files, each opened with Pillow, converted to RGB, cropped and
  resized as torchvision's ``RandomResizedCrop`` does on PIL images, flipped;
* ``limit``: :func:`decode_train` in a bare single-threaded loop over the
  in-memory bytes: the per-image work with no loader around it.

Each is repeated; medians and spreads are reported with the ratios
dimd/torch and (dimd per worker)/limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dimd.checks import at_least
from dimd.errors import DimdError
from dimd.private_apis import dataloader_worker_pids
from dimd.report import spread
from dimd.shuffle.crop import SCALE, crop_box, draw_crops
from dimd.shuffle.loader import BatchLoader
from dimd.shuffle.store import DistributedStore

METHODS = ("dimd", "torch", "limit")


@dataclass(frozen=True)
class BenchIoConfig:
    dataset: Path
    tree: Path
    workers: int = 2
    batch_size: int = 32
    image_size: int = 224
    images: int | None = None  # per measurement; None: every record (whole batches)
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "batch_size", "repeats"):
            at_least(self, name, 1)
        at_least(self, "image_size", 8)
        at_least(self, "images", 1, optional=True)
        at_least(self, "seed", 0)


@dataclass(frozen=True)
class Measurement:
    method: str
    repeat: int
    images: int
    seconds: float
    cpu_seconds: float  # user + system, of every thread and worker process involved

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def images_per_cpu_s(self) -> float:
        return self.images / self.cpu_seconds if self.cpu_seconds > 0 else 0.0


def process_cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of other live processes (DataLoader workers), from /proc."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


class FileDataset:
    """The original files as a map-style dataset, decoded the way torchvision users do.

    dimd's one DataLoader-over-files baseline (``dimd bench-io`` and
    ``bench/train_vs_ddp.py`` use it): Pillow open and RGB convert, a crop
    drawn as ``RandomResizedCrop`` draws it (``crop_scale`` is its smallest
    area share), a bilinear resize to ``image_size``, a random horizontal flip.

    The augmentation is seeded and changes every epoch: each process draws
    from one generator seeded by ``seed`` and, in a DataLoader worker, by the
    worker's seed (which the DataLoader derives from its own ``generator``).
    A DataLoader given a seeded generator so gives the same crops on every
    run, and fresh crops in every epoch.
    """

    def __init__(self, paths: list[Path], labels: np.ndarray, image_size: int, seed: int = 0,
                 crop_scale: float = SCALE[0]) -> None:
        self.paths, self.labels, self.image_size, self.seed = paths, labels, image_size, seed
        self.scale = (crop_scale, 1.0)
        self._rng: np.random.Generator | None = None
        self._rng_owner: tuple[int, int | None] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def generator(self) -> np.random.Generator:
        """This process's augmentation generator (a DataLoader worker has its own)."""
        import os

        from torch.utils.data import get_worker_info

        worker = get_worker_info()
        owner = (os.getpid(), None if worker is None else worker.id)
        if self._rng is None or self._rng_owner != owner:
            entropy = [self.seed] if worker is None else [self.seed, worker.seed]
            self._rng, self._rng_owner = np.random.default_rng(entropy), owner
        return self._rng

    def __getitem__(self, i: int):
        import torch
        from PIL import Image

        rng = self.generator()
        with Image.open(self.paths[i]) as source:
            image = source.convert("RGB")
        tries, position, flip = draw_crops(rng, 1).row(0)
        left, top, w, h = crop_box(*image.size, tries, position, scale=self.scale)
        image = image.crop((left, top, left + w, top + h)).resize((self.image_size,) * 2,
                                                                  Image.Resampling.BILINEAR)
        if flip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(image)).permute(2, 0, 1), int(self.labels[i])


def run_bench_io(config: BenchIoConfig, comm: Any, *,
                 on_measurement: Callable[[Measurement], None] | None = None) -> BenchIoResult:
    """Measure the three methods ``config.repeats`` times each (interleaved) and return the figures."""
    import torch
    from torch.utils.data import DataLoader

    if comm.Get_size() != 1:
        raise DimdError("bench-io measures one process; run it without mpirun")
    store = DistributedStore.load(config.dataset, comm)
    from dimd.format import PackedDataset

    names = PackedDataset(config.dataset).source_names
    paths = [config.tree / names[int(i)] for i in store.global_index]
    missing = [p for p in paths[:50] if not p.is_file()]
    if missing:
        raise DimdError(f"{missing[0]}: not found; `tree` must be the folder {config.dataset} was packed "
                        f"from (record names are paths relative to it)")
    if len(store) < config.batch_size:
        raise DimdError(f"{len(store)} records are fewer than one batch of {config.batch_size}")
    # whole batches; more images than records cycle through further epochs, so a
    # measurement can be long enough that filling and draining the pipeline do not dominate
    batches = (len(store) // config.batch_size if config.images is None
               else max(1, config.images // config.batch_size))
    count = batches * config.batch_size
    torch.set_num_threads(1)

    loader = BatchLoader(store, config.batch_size, config.image_size, train=True,
                         decode_workers=config.workers, seed=config.seed)
    files: Any = FileDataset(paths, store.labels, config.image_size, config.seed)  # a map-style Dataset

    def run_dimd(repeat: int) -> int:
        done, epoch = 0, repeat * 1000
        while done < count:
            for images, _ in loader.epoch(epoch):
                done += len(images)
                if done == count:
                    break
            epoch += 1
        return done

    # a well-configured DataLoader: worker processes started once and kept (persistent_workers);
    # held in a dict so the end of the run can drop it (and so stop its workers) before summarising
    loaders: dict[str, Any] = {"torch": DataLoader(
        files, batch_size=config.batch_size, shuffle=True, drop_last=True, num_workers=config.workers,
        generator=torch.Generator().manual_seed(config.seed), persistent_workers=True, prefetch_factor=2)}

    def worker_pids(method: str) -> list[int]:
        if method == "dimd":
            return loader.worker_pids
        return dataloader_worker_pids(loaders["torch"])

    def run_torch(repeat: int) -> int:
        done = 0
        while done < count:
            for images, _ in loaders["torch"]:
                done += len(images)
                if done == count:
                    break
        return done

    from dimd.shuffle.decode import decode_train

    def run_limit(repeat: int) -> int:
        rng = np.random.default_rng([config.seed, repeat])
        passes = -(-count // len(store))
        order = np.concatenate([rng.permutation(len(store)) for _ in range(passes)])[:count]
        for i in order.tolist():
            decode_train(store.record(i), config.image_size, rng)
        return count

    runners = {"dimd": run_dimd, "torch": run_torch, "limit": run_limit}
    # warm-up: decoding workers, page cache, PIL's plugin import; not measured
    next(iter(loader.epoch(10_000_000)))
    for _ in loaders["torch"]:  # a whole epoch: persistent workers left prefetching would steal dimd's cores
        pass
    measurements: list[Measurement] = []
    for repeat in range(config.repeats):
        for method in METHODS:
            pids = worker_pids(method) if method != "limit" else []
            workers_cpu = process_cpu_seconds(pids)
            start, cpu = time.perf_counter(), time.process_time()
            images = runners[method](repeat)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            cpu += process_cpu_seconds(pids) - workers_cpu   # persistent workers: the same before and after
            measurement = Measurement(method, repeat, images, seconds, cpu)
            measurements.append(measurement)
            if on_measurement is not None:
                on_measurement(measurement)
    loader.close()
    loaders.clear()
    return summarise(config, measurements, records=len(store))


@dataclass(frozen=True)
class BenchIoResult:
    """Per method, images/s and images per CPU-second over the repeats, and the ratios between them."""

    records: int
    methods: dict[str, Any]     # method -> {"images_per_s": spread, "images_per_cpu_s": spread, "images"}
    ratios: dict[str, float | None]


def summarise(config: BenchIoConfig, measurements: list[Measurement], *, records: int) -> BenchIoResult:
    """Per method, images/s and images per CPU-second over the repeats (``dimd.report.spread``), and the ratios."""
    methods: dict[str, Any] = {}
    for method in METHODS:
        mine = [m for m in measurements if m.method == method]
        methods[method] = {"images_per_s": spread(m.images_per_s for m in mine),
                           "images_per_cpu_s": spread(m.images_per_cpu_s for m in mine),
                           "images": mine[0].images}
    dimd, torch_rate, limit = (methods[m]["images_per_s"]["median"] for m in METHODS)
    dimd_cpu, torch_cpu, limit_cpu = (methods[m]["images_per_cpu_s"]["median"] for m in METHODS)
    return BenchIoResult(records=records, methods=methods, ratios={
        "dimd_over_torch": dimd / torch_rate if torch_rate else None,
        "dimd_per_worker_over_limit": dimd / config.workers / limit if limit else None,
        "dimd_over_limit": dimd / limit if limit else None,
        # per CPU-second: what each busy core achieves, robust to other jobs on the machine
        "cpu_dimd_over_torch": dimd_cpu / torch_cpu if torch_cpu else None,
        "cpu_dimd_over_limit": dimd_cpu / limit_cpu if limit_cpu else None,
    })
