"""Caffe LMDB values -> images: encoded datums (any format Pillow reads) or raw CHW BGR pixels."""

from __future__ import annotations

import numpy as np

from dimd.pack.imaging import EncodedImage, ImageSkipped, resize_encoded, resize_pixels


def datum_image(value: bytes, short_side: int, quality: int) -> tuple[int, EncodedImage]:
    """One serialized ``caffe.Datum`` -> (label, RGB JPEG); :class:`ImageSkipped` if unusable."""
    from google.protobuf.message import DecodeError

    from dimd.pack.caffe_datum import parse_datum

    try:
        datum = parse_datum(value)
    except DecodeError as exc:
        raise ImageSkipped(f"not a caffe.Datum ({exc})") from None
    if datum.label < 0:
        raise ImageSkipped(f"negative label {datum.label}")
    if datum.encoded:
        return datum.label, resize_encoded(datum.data, short_side, quality)
    return datum.label, resize_pixels(raw_pixels(datum), short_side, quality)


def raw_pixels(datum) -> np.ndarray:
    """A raw datum's uint8 CHW BGR bytes -> HxW (grey) or HxWx3 RGB, as a numpy view where it can."""
    channels, height, width = datum.channels, datum.height, datum.width
    if not datum.data:
        kind = "float_data (not uint8 pixels)" if len(datum.float_data) else "no pixel data"
        raise ImageSkipped(f"raw datum has {kind}")
    if channels not in (1, 3):
        raise ImageSkipped(f"raw datum has {channels} channels (1 or 3 supported)")
    if height <= 0 or width <= 0 or len(datum.data) != channels * height * width:
        raise ImageSkipped(f"raw datum holds {len(datum.data)} bytes, not "
                           f"channels*height*width = {channels}*{height}*{width}")
    chw = np.frombuffer(datum.data, np.uint8).reshape(channels, height, width)
    if channels == 1:
        return chw[0]
    return chw[::-1].transpose(1, 2, 0)  # BGR planes -> RGB pixels
