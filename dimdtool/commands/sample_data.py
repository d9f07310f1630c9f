"""``dimd sample-data``: the bundled, learnable ImageNet-style sample set."""

from __future__ import annotations

import time
from pathlib import Path

import click

from dimd.console import progress
from dimd.options import OUTPUT_DIR


@click.command("sample-data")
@click.argument("directory", type=OUTPUT_DIR)
@click.option("--classes", default=10, show_default=True, help="Number of classes (shape x colour pairs, at most 80).")
@click.option("--per-class", default=50, show_default=True, help="Images per class.")
@click.option("--seed", default=0, show_default=True, help="Seed; the same seed gives the same files.")
@click.option("--layout", type=click.Choice(["tree", "flat"]), default="tree", show_default=True,
              help="tree: DIR/<class>/*.JPEG (like ImageNet train); flat: DIR/*.JPEG plus "
                   "DIR/labels.txt ('file label' lines) and DIR/classes.txt (like ImageNet val).")
@click.option("--large-share", default=0.15, show_default=True, help="Share of images larger than 1000 px.")
@click.option("--workers", type=int, default=None, help="Processes [default: number of cores].")
def sample_data(directory: Path, classes: int, per_class: int, seed: int, layout: str,
                large_share: float, workers: int | None) -> None:
    """Generate a small ImageNet-style tree of real, learnable JPEG images.

    Each class is a coloured shape (e.g. red-circle) at a random position, scale
    and rotation on a varied background; sizes and aspect ratios vary and a
    share of the images is larger than 1000 px.

    \b
    Example:
      dimd sample-data data/train --classes 10 --per-class 80 --seed 1
      dimd sample-data data/val --classes 10 --per-class 20 --seed 2 --layout flat
    """
    from dimd.sample_data import SampleSpec, generate

    spec = SampleSpec(root=directory, classes=classes, per_class=per_class, seed=seed,
                      layout=layout, large_share=large_share)  # type: ignore[arg-type]
    start = time.perf_counter()
    with progress(classes * per_class, "sample-data", unit="img") as advance:
        result = generate(spec, workers=workers, advance=advance)
    seconds = time.perf_counter() - start
    click.echo(f"wrote {result.images} images in {len(result.classes)} classes to {result.root} "
               f"({result.bytes / 2**20:.1f} MiB, {seconds:.1f}s)"
               + (f"; labels in {result.list_file}" if result.list_file else ""))
