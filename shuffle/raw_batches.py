"""A batch as the GPU decoder takes it: the records' encoded bytes, labels, and the crops to cut.

The CPU decoders (:class:`dimd.shuffle.loader.BatchLoader`) turn a batch of
records into pixels themselves. ``--decode gpu`` hands the bytes to nvJPEG
instead (:mod:`dimd.shuffle.gpu_decode`), so the loader only has to say which
records, and which crop of each: the same records and the same draws of
``(seed, rank, epoch, step)`` as its own decoders would use. Image sizes come
from the JPEG frame header (a few bytes), so the crops are known before any
pixel is decoded, as in DALI's region-of-interest decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import numpy as np

from dimd.shuffle.crop import crop_box, draw_crops
from dimd.shuffle.decode import DecodeError, centre_crop_box
from dimd.shuffle.loader import BatchLoader
from dimd.shuffle.streams import CROPS, stream

#: JPEG start-of-frame markers (SOF0-SOF15, less DHT 0xC4, JPG 0xC8 and DAC 0xCC): they hold the size.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: Markers without a length field: TEM and the restart markers.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


@dataclass
class RawBatch:
    """One batch before decoding: what the loader's decoders would have turned into pixels."""

    records: list[memoryview | bytes]   # encoded JPEG bytes, zero-copy views into the store
    labels: np.ndarray                  # int64
    boxes: np.ndarray                   # float64, N x 4: left, top, width, height in source pixels
    flips: np.ndarray                   # bool: mirror the crop left-right
    sizes: np.ndarray                   # int64, N x 2: each source image's width, height
    image_size: int                     # px: the square each crop is resized to (the epoch's, when training)


def jpeg_size(data: bytes | memoryview) -> tuple[int, int]:
    """(width, height) of a JPEG, read from its frame header without decoding."""
    b = memoryview(data).cast("B") if isinstance(data, memoryview) else data
    if len(b) < 4 or b[0] != 0xFF or b[1] != 0xD8:
        raise DecodeError("not a JPEG (no start-of-image marker)")
    i, n = 2, len(b)
    while i + 9 < n:
        if b[i] != 0xFF:
            raise DecodeError(f"not a valid JPEG (no marker at byte {i})")
        marker = b[i + 1]
        if marker == 0xFF:               # fill byte
            i += 1
        elif marker in _STANDALONE:
            i += 2
        elif marker in _SOF:
            return (b[i + 7] << 8) | b[i + 8], (b[i + 5] << 8) | b[i + 6]
        else:
            i += 2 + ((b[i + 2] << 8) | b[i + 3])
    raise DecodeError("not a valid JPEG (no frame header)")


def raw_batch(loader: BatchLoader, epoch: int, step: int, indices: np.ndarray) -> RawBatch:
    """Batch ``step`` of ``epoch`` (its local record ``indices``), with the loader's own draws."""
    store = loader.store
    records: list[memoryview | bytes] = [store.record(int(i)) for i in indices]
    sizes = np.empty((len(indices), 2), np.int64)
    boxes = np.empty((len(indices), 4), np.float64)
    flips = np.zeros(len(indices), bool)
    image_size = loader.image_size_at(epoch)
    # The loader's workers draw a batch's crops from one generator keyed (seed, rank, epoch, step).
    draws = draw_crops(stream(CROPS, loader.seed, loader.rank, epoch, step), len(indices))
    for slot, record in enumerate(records):
        try:
            width, height = jpeg_size(record)
        except DecodeError as exc:
            raise DecodeError(f"{store.path}: record {int(store.global_index[int(indices[slot])])}: {exc}") from None
        sizes[slot] = width, height
        if loader.train:
            tries, position, flips[slot] = draws.row(slot)
            boxes[slot] = crop_box(width, height, tries, position, loader.crop_scale)
        else:
            boxes[slot] = centre_crop_box(width, height, image_size, loader.crop_ratio)
    labels = store.labels[indices].astype(np.int64)
    return RawBatch(records, labels, boxes, flips, sizes, image_size)


def raw_batches(loader: BatchLoader, epoch: int) -> Generator[RawBatch, None, None]:
    """:meth:`BatchLoader.epoch`'s batches, undecoded, moving the loader's position the same way.

    Asking for the epoch the loader is in continues from its position; a
    finished epoch moves it to the next one; ``state_dict`` and ``seek`` mean
    what they mean for the decoded batches.
    """
    if epoch < 0:
        raise DecodeError(f"epoch must be non-negative (got {epoch})")
    at_epoch, at_step = loader.position
    first = at_step if epoch == at_epoch else 0
    batches = loader.epoch_indices(epoch)
    loader.seek(epoch, first)
    for step in range(first, len(batches)):
        batch = raw_batch(loader, epoch, step, batches[step])
        loader.seek(epoch, step + 1)
        yield batch
    loader.seek(epoch + 1, 0)
