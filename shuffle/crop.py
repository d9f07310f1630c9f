"""The random-resized crop and flip, drawn as torchvision's RandomResizedCrop draws them: one definition.

This module needs nothing but numpy and the standard library, so the peer
loaders' venvs (bench/peers/, no dimd installed) load it by its path and draw
the very same crops as dimd's loader for the same generator state.

The draws are made up front, a whole batch from one generator: for each image
the ten attempts' (area, log-ratio) uniforms, the position's two uniforms and
the flip's. :func:`crop_box` turns one image's draws and its size into a box.
The distribution is torchvision's: the area share uniform in ``scale``, the
log aspect ratio uniform in ``log(ratio)``, the first of ten attempts that
fits, each fitting position equally likely, else the centre crop with the
ratio clamped; a flip with probability 1/2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
#: Evaluation's centre crop over its resize: the shorter side is resized to ``size / EVAL_CROP_RATIO``, then the
#: centre ``size`` square is cut (torchvision's 224 of 256, its ``--val-crop-size`` over ``--val-resize-size``).
EVAL_CROP_RATIO = 224 / 256
ATTEMPTS = 10


@dataclass(frozen=True)
class CropDraws:
    """The uniforms behind n crops: ``tries`` n x ATTEMPTS x 2 (area, ratio), ``position`` n x 2 (left, top),
    ``flip`` n (flip where < 0.5)."""

    tries: np.ndarray
    position: np.ndarray
    flip: np.ndarray

    def __len__(self) -> int:
        return len(self.flip)

    def row(self, i: int) -> tuple[list[list[float]], list[float], bool]:
        """Image ``i``'s draws as Python values: (tries, position, flip)."""
        return self.tries[i].tolist(), self.position[i].tolist(), bool(self.flip[i] < 0.5)


def draw_crops(rng: np.random.Generator, n: int) -> CropDraws:
    """The draws of ``n`` crops and flips, all from ``rng`` in one go (a fixed number per image)."""
    return CropDraws(tries=rng.random((n, ATTEMPTS, 2)), position=rng.random((n, 2)), flip=rng.random(n))


def crop_box(width: int, height: int, tries: list[list[float]], position: list[float],
             scale: tuple[float, float] = SCALE,
             ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """(left, top, crop width, crop height) of a ``width`` x ``height`` image, from one image's draws."""
    area = width * height
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for u_area, u_ratio in tries:
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(log_low + (log_high - log_low) * u_ratio)
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            # floor(u * (k + 1)) is each of 0..k with probability 1 / (k + 1)
            left = min(int(position[0] * (width - w + 1)), width - w)
            top = min(int(position[1] * (height - h + 1)), height - h)
            return left, top, w, h
    in_ratio = width / height  # fallback: the centre crop with the ratio clamped
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: tuple[float, float] = SCALE,
                            ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """One image's box, drawn from ``rng`` (the same as row 0 of ``draw_crops(rng, 1)``)."""
    tries, position, _ = draw_crops(rng, 1).row(0)
    return crop_box(width, height, tries, position, scale, ratio)
