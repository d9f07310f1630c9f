"""What every loader's module in bench/peers/ shares: the command line, the manifest, the timing.

Each peer's module (``dimd_peer.py``, ``ffcv_peer.py``, ...) runs with its own
venv's Python (build/peers/NAME/bin/python; dimd's with .venv) and imports only
this file, numpy, the standard library and its own loader: never dimd (except
dimd's own module), never another peer. It defines a :class:`Peer` and calls
:func:`main`, which gives it three commands, each writing one JSON object:

``pack --manifest DIR --out DIR [--workers N] --json PATH``
    Write the manifest's records (the same short-side-256 JPEG bytes for every
    format) into this peer's format; wall and CPU seconds (worker processes
    included).
``verify --manifest DIR --data DIR --json PATH [--records TSV]``
    Read every record back, raw, without decoding: writes ``name, label,
    crc32, length`` per record to ``--records`` (bench/peer_loaders.py checks
    them against the tree) and the count to the JSON.
``load --manifest DIR --data DIR [--workers N --batch-size B --image-size S --epochs E
      --warmup-epochs W --seed K] --json PATH``
    Training batches: random-resized crop to S x S and a random flip, uint8
    N x 3 x S x S. After W warm-up epochs, E measured epochs, each: the images
    actually delivered (the sum of the batches' first dimension, every batch's
    shape and dtype checked), wall seconds, CPU seconds of this process, its
    threads and every descendant process (DataLoader workers included).

The manifest folder (written by bench/peer_loaders.py) holds ``manifest.tsv``
(``name label crc32 length height width``, one record a line, the packed
order), ``classes.txt`` and ``files/NAME``: each record's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

# ---------------------------------------------------------------------------- the manifest
@dataclass(frozen=True)
class Record:
    name: str
    label: int
    crc32: int
    length: int
    height: int
    width: int


@dataclass(frozen=True)
class Manifest:
    root: Path
    records: list[Record]
    classes: list[str]

    @classmethod
    def read(cls, root: Path) -> "Manifest":
        lines = (root / "manifest.tsv").read_text().splitlines()
        header, rows = lines[0].split("\t"), [line.split("\t") for line in lines[1:] if line]
        if header != ["name", "label", "crc32", "length", "height", "width"]:
            raise SystemExit(f"{root}/manifest.tsv: unexpected header {header}")
        records = [Record(r[0], int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5])) for r in rows]
        classes = (root / "classes.txt").read_text().splitlines()
        return cls(root, records, classes)

    @property
    def files(self) -> Path:
        return self.root / "files"

    def data(self, record: Record) -> bytes:
        return (self.files / record.name).read_bytes()


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


# ---------------------------------------------------------------------------- CPU time
def _stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """Every live descendant process of ``root`` (worker processes and their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_seconds() -> float:
    """user + system seconds of this process (all threads), its reaped children and its live descendants.

    A live descendant counts with its own reaped children (cutime, cstime), so
    a worker that ends between two readings still counts once: in its
    parent's figure (or, if this process reaped it, in RUSAGE_CHILDREN).
    """
    ticks = os.sysconf("SC_CLK_TCK")
    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
    for pid in descendants(os.getpid()):
        fields = _stat(pid)
        if fields is not None:
            total += sum(int(v) for v in fields[11:15]) / ticks  # utime stime cutime cstime
    return total


class Stopwatch:
    """Wall and CPU seconds (see :func:`cpu_seconds`) of a stretch of work."""

    def __enter__(self) -> "Stopwatch":
        self.cpu0, self.wall0 = cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.wall0
        self.cpu_seconds = cpu_seconds() - self.cpu0


# ---------------------------------------------------------------------------- the augmentation
def _load_crop_module() -> Any:
    """dimd's shuffle/crop.py, by its path: the one crop definition, importable without dimd."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "shuffle" / "crop.py"
    spec = importlib.util.spec_from_file_location("dimd_crop", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: cannot load dimd's crop definition")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


_crop = _load_crop_module()
draw_crops = _crop.draw_crops
crop_box = _crop.crop_box
random_resized_crop_box = _crop.random_resized_crop_box


def crop_resize(image: Any, box: tuple[int, int, int, int], size: int) -> Any:
    """What torchvision's ``F.resized_crop`` does to a PIL image: crop, then a bilinear resize."""
    from PIL import Image

    left, top, w, h = box
    return image.crop((left, top, left + w, top + h)).resize((size, size), Image.BILINEAR)


def pil_train_sample(data: bytes | Any, size: int, rng: np.random.Generator) -> Any:
    """torchvision's ``RandomResizedCrop(size)``, ``RandomHorizontalFlip()``, ``PILToTensor()``,
    written with Pillow and numpy for the venvs that have no torchvision: a 3 x S x S uint8 tensor.

    ``data``: encoded bytes, or a PIL image already opened. The full image is
    decoded (no draft mode), as ImageFolder's loader does.
    """
    import io

    import torch
    from PIL import Image

    image = Image.open(io.BytesIO(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data
    image = image.convert("RGB")
    tries, position, flip = draw_crops(rng, 1).row(0)
    image = crop_resize(image, crop_box(*image.size, tries, position), size)
    if flip:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(image, copy=True)).permute(2, 0, 1)   # as PILToTensor


class WorkerRng:
    """One augmentation generator per process (a DataLoader worker gets its own, from its seed)."""

    def __init__(self, seed: int) -> None:
        self.seed, self._owner, self._rng = seed, None, None

    def __call__(self) -> np.random.Generator:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        owner = (os.getpid(), None if info is None else info.id)
        if self._rng is None or self._owner != owner:
            entropy = [self.seed] if info is None else [self.seed, info.seed % 2**32]
            self._rng, self._owner = np.random.default_rng(entropy), owner
        return self._rng

    def __getstate__(self) -> dict:
        return {"seed": self.seed, "_owner": None, "_rng": None}


# ---------------------------------------------------------------------------- a peer
@dataclass
class LoadOptions:
    data: Path
    manifest: Manifest
    workers: int
    batch_size: int
    image_size: int
    seed: int


@dataclass
class Peer:
    """One loader: how it packs, how its records read back raw, how it makes training batches."""

    name: str
    #: (manifest, out folder, workers) -> extra figures for the JSON (e.g. files written)
    pack: Callable[[Manifest, Path, int], dict]
    #: data folder -> (name, label, raw bytes) for every record, in any order
    records: Callable[[Path], Iterable[tuple[str, int, bytes]]]
    #: options -> a function of the epoch number that iterates (images, labels) batches
    loader: Callable[[LoadOptions], Callable[[int], Iterable[tuple[Any, Any]]]]
    #: what differs in how it loads (threads or processes, page cache or own memory, shuffle)
    notes: Callable[[LoadOptions], dict] = lambda options: {}
    versions: Callable[[], dict] = lambda: {}
    #: extra checks for verify (e.g. the augmentation against torchvision's)
    extra_checks: Callable[[Manifest], dict] = lambda manifest: {}
    #: imported before anything is timed: a pack's time is the packing, not the imports
    modules: tuple[str, ...] = ()


def run_epoch(batches: Iterable[tuple[Any, Any]], image_size: int) -> tuple[int, int]:
    """Iterate one epoch; return (images delivered, batches). Every batch is checked."""
    images_total = batches_total = 0
    expected = (3, image_size, image_size)
    for images, labels in batches:
        shape = tuple(images.shape)
        if shape[1:] != expected or "uint8" not in str(images.dtype):
            raise SystemExit(f"a batch of {shape} {images.dtype}; expected N x {expected} uint8")
        if len(labels) != shape[0]:
            raise SystemExit(f"a batch of {shape[0]} images came with {len(labels)} labels")
        images_total += shape[0]
        batches_total += 1
    return images_total, batches_total


def _versions(peer: Peer) -> dict:
    import platform

    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for module in ("torch", "PIL"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:  # a version is information, not a requirement
            pass
    return {**versions, **peer.versions()}


def _write(path: Path, document: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, path)


def main(peer: Peer, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{peer.name}_peer.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p_pack = commands.add_parser("pack")
    p_verify = commands.add_parser("verify")
    p_load = commands.add_parser("load")
    for p in (p_pack, p_verify, p_load):
        p.add_argument("--manifest", type=Path, required=True)
        p.add_argument("--json", type=Path, required=True)
    p_pack.add_argument("--out", type=Path, required=True)
    p_pack.add_argument("--workers", type=int, default=2)
    for p in (p_verify, p_load):
        p.add_argument("--data", type=Path, required=True)
    p_verify.add_argument("--records", type=Path, required=True)
    p_load.add_argument("--workers", type=int, default=2)
    p_load.add_argument("--batch-size", type=int, default=64)
    p_load.add_argument("--image-size", type=int, default=224)
    p_load.add_argument("--epochs", type=int, default=1)
    p_load.add_argument("--warmup-epochs", type=int, default=1)
    p_load.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    manifest = Manifest.read(args.manifest)
    import importlib

    for module in peer.modules:
        importlib.import_module(module)
    document: dict[str, Any] = {"peer": peer.name, "command": args.command, "versions": _versions(peer)}

    if args.command == "pack":
        args.out.mkdir(parents=True, exist_ok=True)
        with Stopwatch() as watch:
            extra = peer.pack(manifest, args.out, args.workers)
        size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
        document.update(records=len(manifest.records), workers=args.workers, seconds=watch.seconds,
                        cpu_seconds=watch.cpu_seconds, bytes=size, **extra)
    elif args.command == "verify":
        count = 0
        with open(args.records, "w") as out:
            out.write("name\tlabel\tcrc32\tlength\n")
            for name, label, data in peer.records(args.data):
                out.write(f"{name}\t{int(label)}\t{crc32(data)}\t{len(data)}\n")
                count += 1
        document.update(records=count, **peer.extra_checks(manifest))
    else:
        options = LoadOptions(args.data, manifest, args.workers, args.batch_size, args.image_size, args.seed)
        epoch_batches = peer.loader(options)
        epochs = []
        for epoch in range(args.warmup_epochs + args.epochs):
            with Stopwatch() as watch:
                images, batches = run_epoch(epoch_batches(epoch), args.image_size)
            epochs.append({"epoch": epoch, "warmup": epoch < args.warmup_epochs, "images": images,
                           "batches": batches, "seconds": watch.seconds, "cpu_seconds": watch.cpu_seconds})
            print(f"{peer.name}: epoch {epoch}{' (warm-up)' if epoch < args.warmup_epochs else ''}: "
                  f"{images} images in {watch.seconds:.2f} s, {watch.cpu_seconds:.2f} CPU-s", file=sys.stderr,
                  flush=True)
        document.update(records=len(manifest.records), workers=args.workers, batch_size=args.batch_size,
                        image_size=args.image_size, seed=args.seed, epochs=epochs, how=peer.notes(options))
    _write(args.json, document)
    return 0

