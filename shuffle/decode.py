"""In-memory JPEG decode with the standard ImageNet augmentation, from bytes to uint8 CHW.

Training: random-resized crop (scale 0.08-1, ratio 3/4-4/3, as torchvision's
``RandomResizedCrop``) to ``image_size`` and a random horizontal flip.
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

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
EVAL_RESIZE_RATIO = 256 / 224


class DecodeError(DimdError):
    """A record's bytes are not a decodable image."""


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: tuple[float, float] = SCALE,
                            ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """(left, top, crop width, crop height), drawn as torchvision's RandomResizedCrop does."""
    area = width * height
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        u_area, u_ratio = rng.random(2)
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(log_low + (log_high - log_low) * u_ratio)
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    in_ratio = width / height  # fallback: the centre crop with the ratio clamped
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def draw_train_crop(width: int, height: int, rng: np.random.Generator,
                    scale: tuple[float, float] = SCALE) -> tuple[tuple[int, int, int, int], bool]:
    """A training image's augmentation, drawn: its random-resized crop box and whether to flip it.

    The CPU decoders and the GPU path (dimd.shuffle.gpu_decode) both draw through here, so the
    same rng gives the same crops wherever the pixels are made.
    """
    box = random_resized_crop_box(width, height, rng, scale)
    return box, bool(rng.random() < 0.5)


def centre_crop_box(width: int, height: int, image_size: int) -> tuple[float, float, float, float]:
    """(left, top, side, side) of evaluation's centre crop: the square that, resized to
    ``image_size``, leaves the shorter side at ``image_size * 256 / 224``."""
    side = image_size * min(width, height) / round(image_size * EVAL_RESIZE_RATIO)
    return (width - side) / 2, (height - side) / 2, side, side


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


def train_hwc(data: bytes | memoryview, image_size: int, rng: np.random.Generator,
              scale: tuple[float, float] = SCALE) -> tuple[np.ndarray, bool]:
    """The random-resized crop as HWC, and whether to flip it (the loader flips while copying)."""
    image = _open(data)
    (left, top, w, h), flip = draw_train_crop(*image.size, rng, scale)
    return _crop_resize(image, (left, top, left + w, top + h), image_size), flip


def eval_hwc(data: bytes | memoryview, image_size: int) -> np.ndarray:
    """The resized centre crop as HWC."""
    image = _open(data)
    left, top, side, _ = centre_crop_box(*image.size, image_size)
    return _crop_resize(image, (left, top, left + side, top + side), image_size)


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
    hwc, flip = train_hwc(data, image_size, rng, scale)
    return to_chw(hwc, flip)


def decode_eval(data: bytes | memoryview, image_size: int) -> np.ndarray:
    """Decode a JPEG, resize to size*256/224 on the shorter side, centre crop: 3 x size x size."""
    return to_chw(eval_hwc(data, image_size))
