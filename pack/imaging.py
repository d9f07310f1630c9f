"""Decode any image Pillow reads, make it RGB, resize its shorter side, encode JPEG.

Speed comes from two places: JPEG draft (DCT-domain) decoding, which lets
libjpeg-turbo decode a large image at 1/2, 1/4 or 1/8 scale when the source is
at least twice the target, and pillow-simd's antialiased resize. The result is
a pure function of the input bytes, so any number of workers writes the same
output.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

from dimd.errors import describe
from dimd.pack.config import JPEG_MAX_SIDE

#: Lower-case extensions of the files a folder source packs; anything else is ignored. Formats
#: this Pillow build may lack (HEIF, AVIF, JPEG 2000, JPEG XL) are listed so that such files are
#: skipped and named, with the reason, rather than passed over in silence.
IMAGE_EXTENSIONS = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp",
    ".ppm", ".pgm", ".pbm", ".pnm", ".heic", ".heif", ".avif", ".jp2", ".j2k", ".jxl",
})
RESAMPLE = Image.Resampling.BICUBIC  # antialiased: the filter widens with the scale factor
#: Draft decoding keeps at least this multiple of the target size, so the antialiased resize
#: still does the final filtering (DCT-domain scaling alone blurs and aliases more).
DRAFT_OVERSAMPLE = 2.0
_JPEG_MAGIC = b"\xff\xd8\xff"
#: EXIF orientation tag value -> the transpose that shows the image upright (as ImageOps.exif_transpose).
EXIF_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90,
}


#: Formats Pillow reads only when built with their library: (test of the first bytes, name, feature).
OPTIONAL_FORMATS = (
    (lambda d: d[:4] == b"RIFF" and d[8:12] == b"WEBP", "WebP", "webp"),
    (lambda d: d[4:8] == b"ftyp" and d[8:12] in (b"avif", b"avis"), "AVIF", "avif"),
    (lambda d: d[4:8] == b"ftyp" and d[8:12] in (b"heic", b"heix", b"hevc", b"heim", b"heis",
                                                 b"mif1", b"msf1"), "HEIF/HEIC", None),
    (lambda d: d[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" or d[:4] == b"\xff\x4f\xff\x51",
     "JPEG 2000", "jpg_2000"),
    (lambda d: d[:2] == b"\xff\x0a" or d[:12] == b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL", None),
)


class ImageSkipped(Exception):
    """An input that is not a usable image (empty, truncated, undecodable); the pack goes on."""


@dataclass(frozen=True)
class EncodedImage:
    data: bytes
    height: int
    width: int


def target_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """(width, height) with the shorter side equal to ``short_side``, aspect ratio kept.

    Raises :class:`ImageSkipped` when the longer side would exceed what a JPEG
    holds (:data:`JPEG_MAX_SIDE`): a 1x5000 strip resized to a short side of
    256 would be 1,280,000 px long. Checked before any pixel is decoded.
    """
    if width < 1 or height < 1:
        raise ImageSkipped(f"has no pixels ({width}x{height})")
    if width <= height:
        target = short_side, max(1, round(height * short_side / width))
    else:
        target = max(1, round(width * short_side / height)), short_side
    if max(target) > JPEG_MAX_SIDE:
        raise ImageSkipped(f"{width}x{height} resized to a short side of {short_side} would be "
                           f"{target[0]}x{target[1]}, longer than a JPEG can be ({JPEG_MAX_SIDE} px)")
    return target


def open_image(data: bytes) -> Image.Image:
    """Open encoded bytes lazily (no pixels decoded yet)."""
    if not data:
        raise ImageSkipped("empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Corrupt EXIF data": the pixels are fine
            # Large but legitimate: JPEGs are draft-decoded, and twice the limit is an error (a skip).
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # A JPEG (nearly always) is identified without trying every other plugin first.
            return Image.open(io.BytesIO(data), formats=("JPEG",) if data[:3] == _JPEG_MAGIC else None)
    except Image.UnidentifiedImageError:
        raise ImageSkipped(unreadable_format(data)) from None
    except Image.DecompressionBombError as exc:
        raise ImageSkipped(f"too large ({exc})") from None
    except Exception as exc:  # corrupt headers reach Pillow's plugins in many ways
        raise ImageSkipped(f"unreadable image ({describe(exc)})") from None


def unreadable_format(data: bytes) -> str:
    """Why Pillow could not identify ``data``: a format this Pillow build lacks, or none at all."""
    from PIL import features

    for test, name, feature in OPTIONAL_FORMATS:
        if test(data):
            if feature is None or not features.check(feature):
                return (f"a {name} image, but this Pillow build ({_pillow_build()}) cannot read {name}"
                        + (f" (it was built without lib{feature})" if feature else ""))
            return f"a {name} image that Pillow cannot read (damaged?)"
    return "not an image Pillow can read"


def _pillow_build() -> str:
    from importlib import metadata

    for distribution in ("pillow-simd", "pillow"):
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return f"Pillow {Image.__version__}"


def resize_encoded(data: bytes, short_side: int, quality: int, *,
                   draft_oversample: float = DRAFT_OVERSAMPLE) -> EncodedImage:
    """Encoded image bytes -> RGB JPEG whose shorter side is ``short_side``.

    A JPEG at least ``2 * draft_oversample`` times the target is decoded at
    1/2, 1/4 or 1/8 scale, never below ``draft_oversample`` times the target.
    """
    image = open_image(data)
    width, height = image.size
    target = target_size(width, height, short_side)
    try:
        if image.format == "JPEG" and draft_oversample > 0:
            # DCT-domain downscale (libjpeg picks the smallest scale that keeps the requested
            # size; it does nothing below 2x), then the antialiased resize does the rest.
            image.draft(image.mode, (int(target[0] * draft_oversample),
                                     int(target[1] * draft_oversample)))
        image.load()
    except Image.DecompressionBombError as exc:
        raise ImageSkipped(f"too large ({exc})") from None
    except Exception as exc:  # truncated or corrupt data: OSError mostly, but not only
        raise ImageSkipped(f"cannot decode ({describe(exc)})") from None
    return _finish(image, target, exif_orientation(image), quality)


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (1 = upright); a broken EXIF block does not lose the image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Corrupt EXIF data", once per image
            value = image.getexif().get(0x0112, 1)
    except Exception:
        return 1
    return value if value in EXIF_TRANSPOSE else 1


def resize_pixels(pixels: np.ndarray, short_side: int, quality: int) -> EncodedImage:
    """An HxW (grey) or HxWx3 (RGB) uint8 array -> RGB JPEG with shorter side ``short_side``."""
    image = Image.fromarray(np.ascontiguousarray(pixels), "L" if pixels.ndim == 2 else "RGB")
    return _finish(image, target_size(image.width, image.height, short_side), 1, quality)


def _finish(image: Image.Image, target: tuple[int, int], orientation: int,
            quality: int) -> EncodedImage:
    image = to_rgb_or_grey(image)
    if image.size != target:
        image = image.resize(target, RESAMPLE)
    if orientation in EXIF_TRANSPOSE:  # after the resize: the same pixels, fewer of them
        image = image.transpose(EXIF_TRANSPOSE[orientation])
    if image.mode != "RGB":
        image = image.convert("RGB")
    out = io.BytesIO()
    try:
        image.save(out, "JPEG", quality=quality)
    except (OSError, ValueError) as exc:  # the encoder refuses it: this record is lost, not the pack
        raise ImageSkipped(f"cannot encode as JPEG ({describe(exc)})") from None
    return EncodedImage(out.getvalue(), image.height, image.width)


def to_rgb_or_grey(image: Image.Image) -> Image.Image:
    """Any mode -> "RGB" or "L" (grey stays one channel until after the resize: 3x cheaper).

    Transparency is composited onto white, so a transparent background does not
    turn black; 16-bit and 32-bit grey keep their top 8 bits instead of clipping.
    """
    mode = image.mode
    if mode in ("RGB", "L"):
        return image
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        mode = image.mode
    elif mode in ("1",):
        return image.convert("L")
    elif mode in ("I;16", "I;16L", "I;16B", "I;16N"):
        return Image.fromarray((np.asarray(image, np.uint16) >> 8).astype(np.uint8), "L")
    elif mode == "I" and _band_max(image) <= 65535:  # 16-bit grey opened as 32-bit
        shift = 8 if _band_max(image) > 255 else 0
        return Image.fromarray((np.asarray(image, np.int64).clip(0) >> shift).astype(np.uint8), "L")
    elif mode in ("I", "F"):  # other 32-bit data: scale the range onto 0..255
        values = np.asarray(image, np.float64)
        top = values.max() if values.size else 0
        scale = 255.0 / top if top > 255 else 1.0
        return Image.fromarray(np.clip(values * scale, 0, 255).astype(np.uint8), "L")
    elif mode == "PA":
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "RGBa", "La"):
        if mode in ("RGBa", "La"):
            image = image.convert(mode[0:-1] + "A")
        alpha = image.getchannel("A")
        base = image.convert("L" if image.mode == "LA" else "RGB")
        background = Image.new(base.mode, base.size, 255 if base.mode == "L" else (255, 255, 255))
        background.paste(base, mask=alpha)
        return background
    return image.convert("RGB")  # CMYK, YCbCr, LAB, HSV, RGBX, ...


def _band_max(image: Image.Image) -> float:
    """The largest value of a one-band image (``getextrema`` gives (min, max) for one band)."""
    extrema = image.getextrema()
    return float(extrema[1])  # type: ignore[arg-type]  # one band: a pair of numbers
