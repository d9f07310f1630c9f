"""In-memory JPEG decode with the standard ImageNet augmentation, from bytes to uint8 CHW.

Training: random-resized crop (scale 0.08-1, ratio 3/4-4/3, as torchvision's
``RandomResizedCrop``; drawn by :mod:`dimd.shuffle.crop`) to ``image_size``
and a random horizontal flip.
Evaluation: resize the shorter side to ``image_size / crop_ratio`` (by default
``image_size * 256 / 224``, :data:`~dimd.shuffle.crop.EVAL_CROP_RATIO`) and take
the centre ``image_size`` square. Both decode in the DCT domain ("draft" mode) at
the smallest power-of-two reduction that still leaves the crop at least
``image_size`` pixels, and crop and resize in one ``Image.resize(box=...)``.
Normalisation (float, mean/std) belongs to the consumer, on its device.

Colour JPEGs decode only the region the crop needs (the box plus the resize
filter's reach) through :mod:`dimd.shuffle._jpeg_region`, libjpeg-turbo's
region decode with the GIL released; the region's pixels are the full
decode's, so the crop is the same image (``tests/test_jpeg_region.py``).
Grey and CMYK JPEGs, other formats, and an install built without the
extension take Pillow's full decode.
"""

from __future__ import annotations

import importlib
import io
import math
import threading
from typing import Any, Callable

import numpy as np

from dimd.errors import DimdError
from dimd.shuffle.crop import EVAL_CROP_RATIO, SCALE, crop_box, draw_crops


def _region_decoder() -> Any:
    """The compiled region decoder, or None where pip could not build it (no libjpeg-turbo headers):
    then Pillow's full decode serves every image."""
    try:
        return importlib.import_module("dimd.shuffle._jpeg_region")
    except ImportError:
        return None


_jpeg_region = _region_decoder()

#: A crop's (left, top, right, bottom) in the image's pixels.
Box = tuple[float, float, float, float]
#: Pixels decoded beyond the box on each side, on top of the bilinear filter's reach (``scale`` pixels
#: when shrinking by ``scale``), so that the resize reads exactly what it reads in the full image.
REGION_MARGIN = 2
#: How the region decoder's message starts when libjpeg only warned (see shuffle/_jpeg_region.c).
REGION_WARNING = "warning: "


class DecodeError(DimdError):
    """A record's bytes are not a decodable image."""


def _open(data: bytes | memoryview):
    from PIL import Image, UnidentifiedImageError

    try:
        opened = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:   # its text names the BytesIO object, not the record
        raise DecodeError("not a decodable image (no image format recognised)") from None
    except Exception as exc:  # PIL raises OSError, ValueError...
        raise DecodeError(f"not a decodable image ({exc})") from None
    return opened if opened.mode in ("RGB", "L", "CMYK") else opened.convert("RGB")


def draft_scale(width: int, height: int, box: Box, size: int) -> int:
    """The DCT reduction (1, 2, 4 or 8) Pillow's ``draft`` picks for the smallest decode that keeps
    ``box`` at least ``size`` pixels (Pillow's own rule, so both decode paths pick the same)."""
    left, top, right, bottom = box
    k = size / min(right - left, bottom - top)
    if k >= 1:
        return 1
    fits = min(width // math.ceil(width * k), height // math.ceil(height * k))
    return next(s for s in (8, 4, 2, 1) if fits >= s)


_scratch = threading.local()


def _region_buffer(nbytes: int) -> np.ndarray:
    """This thread's reusable buffer for a decoded region, grown as needed."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < nbytes:
        buffer = _scratch.buffer = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buffer


def _region(width: int, height: int, scaled: tuple[int, int], box: Box,
            size: int) -> tuple[tuple[int, int, int, int], Box]:
    """The pixels the resize of ``box`` reads, in the image decoded at ``scaled`` size: (x0, y0, x1, y1),
    with a margin; and the box within that region. Both decode paths resize the same region with the
    same box, so their crops are equal to the bit."""
    sx, sy = scaled[0] / width, scaled[1] / height
    left, top, right, bottom = box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy
    reach_x = math.ceil(max((right - left) / size, 1.0)) + REGION_MARGIN
    reach_y = math.ceil(max((bottom - top) / size, 1.0)) + REGION_MARGIN
    x0, y0 = max(0, math.floor(left) - reach_x), max(0, math.floor(top) - reach_y)
    x1, y1 = min(scaled[0], math.ceil(right) + reach_x), min(scaled[1], math.ceil(bottom) + reach_y)
    return (x0, y0, x1, y1), (left - x0, top - y0, right - x0, bottom - y0)


def _resize(image, box: Box, size: int) -> np.ndarray:
    """Crop+resize to size x size in one bilinear resize, as HWC RGB."""
    from PIL import Image

    out = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if out.mode not in ("RGB", "RGBX"):
        out = out.convert("RGB")
    return np.asarray(out)[:, :, :3]


def _region_crop_resize(data: bytes | memoryview, width: int, height: int,
                        box: Box, size: int) -> np.ndarray | None:
    """Decode only the region around ``box`` (at Pillow's draft scale), crop+resize it to size x size;
    None where libjpeg warned (the caller asks Pillow)."""
    from PIL import Image

    scale = draft_scale(width, height, box, size)
    (x0, y0, x1, y1), inner = _region(width, height, (-(-width // scale), -(-height // scale)), box, size)
    buffer = _region_buffer((x1 - x0 + 16) * (y1 - y0) * 4 + 64)   # crop_scanline widens by < 16 columns
    try:
        x, _, w, _ = _jpeg_region.decode(data, scale, x0, y0, x1, y1, buffer)
    except ValueError as exc:
        if str(exc).startswith(REGION_WARNING):
            return None   # corrupt or extraneous data: Pillow decides, as it did before the region decode
        raise DecodeError(f"not a decodable image ({exc})") from None
    # the region from (x0, y0): the decoded rows start at x <= x0 (an iMCU boundary)
    view = Image.frombuffer("RGBX", (x1 - x0, y1 - y0), buffer[(x0 - x) * 4:], "raw", "RGBX", w * 4, 1)
    return _resize(view, inner, size)


def _shape(data: bytes | memoryview) -> tuple[int, int] | None:
    """(width, height) of a colour JPEG whose region can be decoded alone, else None (Pillow decodes it)."""
    if _jpeg_region is None or bytes(data[:2]) != b"\xff\xd8" or bytes(data[-2:]) != b"\xff\xd9":
        return None   # not a JPEG, or one cut short (Pillow refuses it whichever rows a crop needs)
    try:
        width, height, region = _jpeg_region.shape(data)
    except ValueError:
        return None   # Pillow says what is wrong with it
    return (width, height) if region else None


def _crop_resize(image, box: Box, size: int) -> np.ndarray:
    """Draft-decode so the box keeps >= ``size`` pixels, crop+resize to size x size, as HWC RGB."""
    width, height = image.size
    left, top, right, bottom = box
    k = size / min(right - left, bottom - top)
    if k < 1 and image.format == "JPEG":
        image.draft("RGB", (math.ceil(width * k), math.ceil(height * k)))
    region, inner = _region(width, height, image.size, box, size)
    try:
        return _resize(image.crop(region), inner, size)
    except Exception as exc:
        raise DecodeError(f"not a decodable image ({exc})") from None


def _decode_crop(data: bytes | memoryview, size: int, box_for: Callable[[int, int], Box]) -> np.ndarray:
    """Decode and crop+resize the box that ``box_for(width, height)`` gives: by the region decoder
    where it can, else by Pillow's full decode."""
    shape = _shape(data)
    if shape is not None:
        crop = _region_crop_resize(data, *shape, box_for(*shape), size)
        if crop is not None:
            return crop
    image = _open(data)
    return _crop_resize(image, box_for(*image.size), size)


def crop_hwc(data: bytes | memoryview, image_size: int, tries: list[list[float]], position: list[float],
             scale: tuple[float, float] = SCALE) -> np.ndarray:
    """The random-resized crop given by one image's draws (see :mod:`dimd.shuffle.crop`), as HWC."""
    def box(width: int, height: int) -> Box:
        left, top, w, h = crop_box(width, height, tries, position, scale)
        return left, top, left + w, top + h

    return _decode_crop(data, image_size, box)


def eval_hwc(data: bytes | memoryview, image_size: int, crop_ratio: float = EVAL_CROP_RATIO) -> np.ndarray:
    """The resized centre crop as HWC."""
    def box(width: int, height: int) -> Box:
        left, top, side, _ = centre_crop_box(width, height, image_size, crop_ratio)
        return left, top, left + side, top + side

    return _decode_crop(data, image_size, box)


def centre_crop_box(width: int, height: int, image_size: int,
                    crop_ratio: float = EVAL_CROP_RATIO) -> tuple[float, float, float, float]:
    """(left, top, side, side) of evaluation's centre crop: the square that, resized to ``image_size``,
    leaves the shorter side at ``image_size / crop_ratio`` (the GPU path cuts the same box)."""
    side = image_size * min(width, height) / resize_side(image_size, crop_ratio)
    return (width - side) / 2, (height - side) / 2, side, side


def resize_side(image_size: int, crop_ratio: float = EVAL_CROP_RATIO) -> int:
    """The shorter side evaluation resizes to, before its centre ``image_size`` crop: 256 for 224 at 224/256."""
    return round(image_size / crop_ratio)


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


def decode_eval(data: bytes | memoryview, image_size: int, crop_ratio: float = EVAL_CROP_RATIO) -> np.ndarray:
    """Decode a JPEG, resize to size / crop_ratio (size*256/224) on the shorter side, centre crop: 3 x size x size."""
    return to_chw(eval_hwc(data, image_size, crop_ratio))
