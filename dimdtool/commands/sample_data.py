"""``dimd sample-data``: the bundled, learnable ImageNet-style sample set."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from dimd.console import progress
from dimd.options import OUTPUT_DIR, build_config, config_option, processes_option, quiet_option
from dimd.sample_data import LAYOUTS, MAX_CLASSES, SampleSpec


@click.command("sample-data")
@click.argument("directory", type=OUTPUT_DIR)
@config_option(SampleSpec, "classes", help=f"Number of classes (shape x colour pairs, at most {MAX_CLASSES}).")
@config_option(SampleSpec, "per_class", help="Images per class.")
@config_option(SampleSpec, "seed", help="Seed; the same seed gives the same files.")
@config_option(SampleSpec, "layout", type=click.Choice(LAYOUTS),
               help="tree: DIR/<class>/*.JPEG (like ImageNet train); flat: DIR/*.JPEG plus "
                    "DIR/labels.txt ('file label' lines) and DIR/classes.txt (like ImageNet val).")
@config_option(SampleSpec, "large_share", help="Share of images larger than 1000 px.")
@processes_option("Processes")
@quiet_option()
def sample_data(directory: Path, workers: int | None, quiet: bool, **fields: Any) -> None:
    """Generate a small ImageNet-style tree of real, learnable JPEG images.

    Each class is a coloured shape (e.g. red-circle) at a random position, scale
    and rotation on a varied background; sizes and aspect ratios vary and a
    share of the images is larger than 1000 px.

    \b
    Example:
      dimd sample-data data/train --classes 10 --per-class 80 --seed 1
      dimd sample-data data/val --classes 10 --per-class 20 --seed 2 --layout flat
    """
    from dimd.sample_data import generate

    spec = build_config(SampleSpec, root=directory, **fields)
    start = time.perf_counter()
    with progress(spec.classes * spec.per_class, "sample-data", unit="img", enabled=not quiet) as advance:
        result = generate(spec, workers=workers, advance=advance)
    seconds = time.perf_counter() - start
    click.echo(f"wrote {result.images} images in {len(result.classes)} classes to {result.root} "
               f"({result.bytes / 2**20:.1f} MiB, {seconds:.1f}s)"
               + (f"; labels in {result.list_file}" if result.list_file else ""))
