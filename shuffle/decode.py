"""In-memory JPEG decode with the standard ImageNet augmentation, from bytes to uint8 CHW.

Training: random-resized crop (scale 0.08-1, ratio 3/4-4/3, as torchvision's
``RandomResizedCrop``; drawn by :mod:`dimd.shuffle.crop`) to ``image_size``
and a random horizontal flip.
Evaluation: resize the shorter side to ``image_size * 256 / 224`` and take the
centre ``image_size`` square. Both decode in the DCT domain ("draft" mode) at
the smallest power-of-two reduction that still leaves the crop at least
``image_size`` pixels, and crop and resize in one ``Image.resize(box=...)``.
Normalisation (float, mean/std) belongs to the consumer, on its device.
"""

from __future__ import annotations

import io
import math

import numpy as np

from dimd.errors import DimdError
from dimd.shuffle.crop import SCALE, crop_box, draw_crops

EVAL_RESIZE_RATIO = 256 / 224


class DecodeError(DimdError):
    """A record's bytes are not a decodable image."""


def _open(data: bytes | memoryview):
    from PIL import Image

    try:
        opened = Image.open(io.BytesIO(data))
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, ValueError...
        raise DecodeError(f"not a decodable image ({exc})") from None
    return opened if opened.mode in ("RGB", "L", "CMYK") else opened.convert("RGB")


def _crop_resize(image, box: tuple[float, float, float, float], size: int) -> np.ndarray:
    """Draft-decode so the box keeps >= ``size`` pixels, crop+resize to size x size, as HWC RGB."""
    from PIL import Image

    width, height = image.size
    left, top, right, bottom = box
    k = size / min(right - left, bottom - top)
    if k < 1 and image.format == "JPEG":
        image.draft("RGB", (math.ceil(width * k), math.ceil(height * k)))
        sx, sy = image.size[0] / width, image.size[1] / height
        box = (left * sx, top * sy, right * sx, bottom * sy)
    try:
        out = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
        if out.mode != "RGB":
            out = out.convert("RGB")
        return np.asarray(out)
    except Exception as exc:
        raise DecodeError(f"not a decodable image ({exc})") from None


def crop_hwc(data: bytes | memoryview, image_size: int, tries: list[list[float]], position: list[float],
             scale: tuple[float, float] = SCALE) -> np.ndarray:
    """The random-resized crop given by one image's draws (see :mod:`dimd.shuffle.crop`), as HWC."""
    image = _open(data)
    width, height = image.size
    left, top, w, h = crop_box(width, height, tries, position, scale)
    return _crop_resize(image, (left, top, left + w, top + h), image_size)


def eval_hwc(data: bytes | memoryview, image_size: int) -> np.ndarray:
    """The resized centre crop as HWC."""
    image = _open(data)
    width, height = image.size
    left, top, side, _ = centre_crop_box(width, height, image_size)
    return _crop_resize(image, (left, top, left + side, top + side), image_size)


def centre_crop_box(width: int, height: int, image_size: int) -> tuple[float, float, float, float]:
    """(left, top, side, side) of evaluation's centre crop: the square that, resized to ``image_size``,
    leaves the shorter side at ``image_size * 256 / 224`` (the GPU path cuts the same box)."""
    side = image_size * min(width, height) / round(image_size * EVAL_RESIZE_RATIO)
    return (width - side) / 2, (height - side) / 2, side, side


def to_chw(hwc: np.ndarray, flip: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """HWC -> CHW uint8 (one copy), mirrored left-right when ``flip``."""
    source = hwc.transpose(2, 0, 1)
    if flip:
        source = source[:, :, ::-1]
    if out is None:
        return np.ascontiguousarray(source)
    np.copyto(out, source)
    return out


def decode_train(data: bytes | memoryview, image_size: int, rng: np.random.Generator,
                 scale: tuple[float, float] = SCALE) -> np.ndarray:
    """Decode a JPEG and apply random-resized crop + random flip: 3 x size x size uint8.

    ``scale`` bounds the share of the image area a crop keeps; ImageNet
    training uses 0.08-1, small images (32 px) learn better from 0.35-1.
    """
    tries, position, flip = draw_crops(rng, 1).row(0)
    return to_chw(crop_hwc(data, image_size, tries, position, scale), flip)


def decode_eval(data: bytes | memoryview, image_size: int) -> np.ndarray:
    """Decode a JPEG, resize to size*256/224 on the shorter side, centre crop: 3 x size x size."""
    return to_chw(eval_hwc(data, image_size))
