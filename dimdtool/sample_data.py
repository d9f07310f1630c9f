"""A small ImageNet-style set of real JPEG files whose classes can be learned.

Each class is a (shape, colour) pair drawn on a varied, muted background at a
random position, scale and rotation; images have mixed sizes and aspect
ratios, and a share of them are larger than 1000 px so that packing exercises
draft decoding. Every image is generated from its own seed, so the output is
the same for any number of workers. Each image is written under a hidden
temporary name and renamed into place, so no file is ever a truncated JPEG; a
write that fails (a full disk) ends the run in one line.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

from dimd.checks import at_least, in_range, one_of
from dimd.errors import ConfigError, DimdError, describe
from dimd.progress import Advance

SHAPES = ("circle", "square", "triangle", "cross", "star", "ring", "diamond", "bar")
COLOURS = {
    "red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (240, 220, 20),
    "magenta": (210, 30, 200), "cyan": (20, 210, 220), "orange": (250, 130, 10),
    "purple": (110, 30, 160), "white": (250, 250, 250), "black": (10, 10, 10),
}
MAX_CLASSES = len(SHAPES) * len(COLOURS)
SampleLayout = Literal["tree", "flat"]
LAYOUTS: tuple[str, ...] = ("tree", "flat")


@dataclass(frozen=True)
class SampleSpec:
    root: Path
    classes: int = 10
    per_class: int = 50
    seed: int = 0
    layout: SampleLayout = "tree"
    large_share: float = 0.15
    quality: int = 92

    def __post_init__(self) -> None:
        in_range(self, "classes", 1, MAX_CLASSES)
        at_least(self, "per_class", 1)
        at_least(self, "seed", 0)
        one_of(self, "layout", LAYOUTS)
        in_range(self, "large_share", 0.0, 1.0)
        in_range(self, "quality", 1, 100)


@dataclass(frozen=True)
class SampleResult:
    root: Path
    images: int
    classes: list[str]
    bytes: int
    list_file: Path | None


def class_names(count: int) -> list[str]:
    """Class ``i`` is shape ``i % S`` in colour ``(i + i // S) % C``: all pairs distinct."""
    if not 1 <= count <= MAX_CLASSES:
        raise ConfigError("classes", f"must be between 1 and {MAX_CLASSES} (got {count})")
    colours = list(COLOURS)
    return [f"{colours[(i + i // len(SHAPES)) % len(colours)]}-{SHAPES[i % len(SHAPES)]}"
            for i in range(count)]


def generate(spec: SampleSpec, *, workers: int | None = None,
             advance: Advance | None = None) -> SampleResult:
    """Write the images of ``spec`` under ``spec.root``; see the module docstring."""
    names = class_names(spec.classes)
    root = Path(spec.root)
    root.mkdir(parents=True, exist_ok=True)
    jobs = []
    for label, name in enumerate(names):
        for j in range(spec.per_class):
            if spec.layout == "tree":
                relative = f"{name}/{name}_{j:05d}.JPEG"
            else:
                relative = f"img_{label * spec.per_class + j:07d}.JPEG"
            jobs.append((str(root / relative), name, label, j, spec.seed, spec.large_share, spec.quality))
    if spec.layout == "tree":
        for name in names:
            (root / name).mkdir(exist_ok=True)
    workers = workers or os.cpu_count() or 1
    total = 0
    try:
        with contextlib.ExitStack() as stack:
            results: Iterator[int]
            if workers == 1:
                results = map(_render_job, jobs)
            else:
                pool = ProcessPoolExecutor(workers)
                stack.callback(pool.shutdown, cancel_futures=True)  # a failure stops the jobs not begun
                results = pool.map(_render_job, jobs, chunksize=8)
            for size in results:
                total += size
                if advance:
                    advance(1)
        list_file = None
        if spec.layout == "flat":
            from dimd.fsutil import atomic_write_text

            list_file = root / "labels.txt"
            atomic_write_text(list_file, "".join(f"{Path(job[0]).name} {job[2]}\n" for job in jobs))
            atomic_write_text(root / "classes.txt", "".join(f"{n}\n" for n in names))
    except OSError as exc:
        raise DimdError(f"{exc.filename or root}: cannot write ({describe(exc)}); the sample set "
                        f"in {root} is incomplete") from None
    return SampleResult(root=root, images=len(jobs), classes=names, bytes=total, list_file=list_file)


def _render_job(job: tuple) -> int:
    from dimd.fsutil import temporary_sibling

    path, name, label, index, seed, large_share, quality = job
    rng = np.random.default_rng([seed, label, index])
    image = render(name, rng, large_share)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    tmp = temporary_sibling(Path(path))
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
        os.replace(tmp, path)
    except OSError as exc:  # named after the image, not its temporary
        raise OSError(exc.errno, exc.strerror, path) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return buffer.tell()


def render(class_name: str, rng: np.random.Generator, large_share: float = 0.15):
    """One image of ``class_name`` ("colour-shape"), as a PIL RGB image."""
    from PIL import Image, ImageDraw, ImageFilter

    colour_name, shape = class_name.split("-", 1)
    width, height = _image_size(rng, large_share)
    image = Image.fromarray(_background(rng, width, height), "RGB")
    draw = ImageDraw.Draw(image, "RGBA")
    _clutter(draw, rng, width, height)
    short = min(width, height)
    size = short * rng.uniform(0.25, 0.6)
    cx = rng.uniform(size / 2, width - size / 2)
    cy = rng.uniform(size / 2, height - size / 2)
    base = np.array(COLOURS[colour_name], float)
    red, green, blue = (int(v) for v in np.clip(base + rng.normal(0, 12, 3), 0, 255))
    colour = (red, green, blue)
    _draw_shape(draw, shape, cx, cy, size, rng.uniform(0, 2 * math.pi), colour)
    if rng.random() < 0.3:
        image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.5, 1.5))))
    return image


def _image_size(rng: np.random.Generator, large_share: float) -> tuple[int, int]:
    aspect = float(np.exp(rng.uniform(math.log(0.6), math.log(1.8))))
    if rng.random() < large_share:
        long_side = int(rng.integers(1000, 2200))
    else:
        long_side = int(rng.integers(300, 720))
    short_side = max(int(long_side / max(aspect, 1 / aspect)), 96)
    return (long_side, short_side) if aspect >= 1 else (short_side, long_side)


def _background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A muted two-colour gradient with mild noise: varied, never class-coloured."""
    grey = rng.uniform(60, 200)
    c0 = np.clip(grey + rng.normal(0, 25, 3), 0, 255)
    c1 = np.clip(rng.uniform(60, 200) + rng.normal(0, 25, 3), 0, 255)
    angle = rng.uniform(0, 2 * math.pi)
    x = np.linspace(0, 1, width, dtype=np.float32)
    y = np.linspace(0, 1, height, dtype=np.float32)
    t = (math.cos(angle) * x[None, :] + math.sin(angle) * y[:, None])
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    img = c0[None, None, :] * (1 - t[..., None]) + c1[None, None, :] * t[..., None]
    noise = rng.normal(0, 6, (height // 4 + 1, width // 4 + 1, 1)).astype(np.float32)
    img += np.repeat(np.repeat(noise, 4, 0), 4, 1)[:height, :width]
    return np.clip(img, 0, 255).astype(np.uint8)


def _clutter(draw, rng: np.random.Generator, width: int, height: int) -> None:
    """Translucent grey ellipses and lines: texture that carries no class signal."""
    for _ in range(int(rng.integers(2, 7))):
        g = int(rng.uniform(40, 220))
        box = sorted(rng.uniform(0, width, 2)), sorted(rng.uniform(0, height, 2))
        fill = (g, g, g, int(rng.uniform(30, 90)))
        if rng.random() < 0.5:
            draw.ellipse([box[0][0], box[1][0], box[0][1], box[1][1]], fill=fill)
        else:
            draw.line([box[0][0], box[1][0], box[0][1], box[1][1]], fill=fill,
                      width=int(rng.integers(2, 12)))


def _draw_shape(draw, shape: str, cx: float, cy: float, size: float, angle: float,
                colour: tuple[int, int, int]) -> None:
    r = size / 2

    def polygon(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        c, s = math.cos(angle), math.sin(angle)
        return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in points]

    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=colour, width=max(int(r * 0.3), 2))
    elif shape == "square":
        draw.polygon(polygon([(-r, -r), (r, -r), (r, r), (-r, r)]), fill=colour)
    elif shape == "diamond":
        draw.polygon(polygon([(0, -r), (r * 0.6, 0), (0, r), (-r * 0.6, 0)]), fill=colour)
    elif shape == "triangle":
        draw.polygon(polygon([(r * math.cos(a), r * math.sin(a))
                              for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]), fill=colour)
    elif shape == "bar":
        draw.polygon(polygon([(-r, -r * 0.22), (r, -r * 0.22), (r, r * 0.22), (-r, r * 0.22)]), fill=colour)
    elif shape == "cross":
        w = r * 0.3
        draw.polygon(polygon([(-r, -w), (r, -w), (r, w), (-r, w)]), fill=colour)
        draw.polygon(polygon([(-w, -r), (w, -r), (w, r), (-w, r)]), fill=colour)
    elif shape == "star":
        points = [((r if k % 2 == 0 else r * 0.42) * math.cos(k * math.pi / 5 - math.pi / 2),
                   (r if k % 2 == 0 else r * 0.42) * math.sin(k * math.pi / 5 - math.pi / 2))
                  for k in range(10)]
        draw.polygon(polygon(points), fill=colour)
    else:  # pragma: no cover - SHAPES is closed
        raise ValueError(shape)
