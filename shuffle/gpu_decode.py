"""``--decode gpu``: a batch's JPEGs decoded by nvJPEG in one call, then cropped, resized and flipped
on the device in a few batched kernels.

Only :func:`decode_jpegs` needs torchvision (``torchvision.io.decode_jpeg`` on
a list, ``device="cuda"``: one batched nvJPEG call; the optional extra
``dimd[gpu]``). Everything after it is plain torch, runs on any device, and
is tested on the CPU against the CPU decoders' pixels.

How the crop is made. DALI's ``decoders.image_random_crop`` draws the crop
window first and decodes only that region of interest (nvJPEG's ROI decode),
so no pixel outside the crop is produced; the resize is a separate operator.
torchvision's batched call cannot decode a region, so here the whole image is
decoded, and the region of interest is then the first step on the device:

1. the decoded images are laid end to end in one buffer, and only the rows
   and columns the crops' filters reach are read from it;
2. the resize is separable: a horizontal pass over the crops' rows, then a
   vertical one; each pass is a few gather-multiply-add kernels, one per
   filter tap (3 for a crop up to the output size, 2 * ceil(scale) + 1 for a
   shrink), each over the whole batch; a left-right flip reverses the
   horizontal pass's outputs (free);
3. the weights are Pillow's bilinear ``resize(box=...)`` coefficients (a
   triangle filter widened by the scale factor, so a shrink is antialiased,
   renormalised at the image's edges), and the horizontal pass is rounded to
   8 bits before the vertical one, as Pillow does. So the pixels match the
   CPU path's wherever the CPU path does not draft-decode (see below).

The CPU decoders decode in the DCT domain at a power-of-two reduction when a
crop is at least twice the output size (JPEG draft mode); the GPU path always
resamples from the full-size image, so for such crops the two differ by what
draft mode's own downscale changes (at 224 px from images packed at a short
side of 256, no crop is that large).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dimd.shuffle.raw_batches import RawBatch

#: The largest difference from the CPU decoders' pixels (0-255) on the same crop of the same decoded
#: image: Pillow-SIMD's fixed-point coefficients and rounding against float32 here.
PIXEL_TOLERANCE = 1


def gpu_decode_problem() -> str | None:
    """Why ``--decode gpu`` cannot run here (one line), or None when it can."""
    if not torch.cuda.is_available():
        return "decode gpu needs a CUDA device; this torch build or machine has none (use `decode` cpu)"
    try:
        import torchvision.io  # noqa: F401
    except ImportError as exc:
        return (f"decode gpu needs torchvision built for this torch {torch.__version__} "
                f"(pip install 'dimd[gpu]'): {exc}")
    return None


def decode_jpegs(records: Sequence[memoryview | bytes], device: torch.device) -> list[torch.Tensor]:
    """JPEG bytes -> 3 x H x W uint8 RGB tensors on ``device``, in one batched nvJPEG call on CUDA."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if torch.device(device).type == "cuda":
        # torchvision allocates the outputs on the current stream but writes them from nvJPEG's own
        # stream without waiting for this one (pytorch/vision#9606): memory freed here by kernels
        # still queued could be handed to nvJPEG. The queue is a batch old by now: the wait is short.
        torch.cuda.current_stream(device).synchronize()
    data = [torch.frombuffer(bytearray(r) if isinstance(r, memoryview) and r.readonly else r, dtype=torch.uint8)
            for r in records]
    return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def _taps(lengths: np.ndarray, size: int) -> int:
    """Taps per output in the batch: Pillow's kernel size, 2 * ceil(max(scale, 1)) + 1, at the largest scale."""
    return int(2 * np.ceil(np.maximum(lengths / size, 1.0)).max() + 1)


def _rows(starts: np.ndarray, lengths: np.ndarray, limits: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """The source rows each image's vertical pass reads: where they begin, and how many at most
    in the batch (host arithmetic, Pillow's: the first output's lowest tap to the last's highest)."""
    scale = lengths / size
    support = np.maximum(scale, 1.0)
    first = np.maximum(np.trunc(starts + 0.5 * scale - support + 0.5), 0).astype(np.int64)
    last = np.minimum(np.trunc(starts + (size - 0.5) * scale + support + 0.5), limits).astype(np.int64)
    return first, int((last - first).max())


def resample_weights(starts: torch.Tensor, lengths: torch.Tensor, limits: torch.Tensor, size: int,
                     taps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pillow's bilinear ``resize(box=...)`` along one axis, for N images at once.

    Output ``i`` of image ``n`` is the weighted sum of source pixels
    ``first[n, i] + k`` (``k < taps``) with ``weights[n, i, k]``: the crop
    runs from ``starts[n]`` for ``lengths[n]`` pixels of an axis ``limits[n]``
    long. As Pillow's ``precompute_coeffs``: a triangle of half-width
    max(scale, 1) around the output's centre, taps outside the image dropped,
    each output's weights renormalised to sum to 1. Returns ``(first, weights)``:
    N x size int64 and N x size x taps float32.
    """
    device = starts.device
    scale = (lengths / size).view(-1, 1)
    support = scale.clamp(min=1.0)
    outputs = torch.arange(size, dtype=torch.float64, device=device)
    centre = starts.view(-1, 1) + (outputs + 0.5) * scale                               # N x size
    low = torch.trunc(centre - support + 0.5).clamp(min=0)
    high = torch.minimum(torch.trunc(centre + support + 0.5), limits.view(-1, 1))
    position = low.unsqueeze(-1) + torch.arange(taps, dtype=torch.float64, device=device)   # N x size x taps
    weights = (1 - ((position - centre.unsqueeze(-1) + 0.5) / support.unsqueeze(-1)).abs()).clamp(min=0)
    weights = weights * (position < high.unsqueeze(-1))
    weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-12)
    return low.long(), weights.float()


def _round_to_byte(x: torch.Tensor) -> torch.Tensor:
    """Round half up and clip to 0..255, as Pillow's fixed-point passes do (kept in float)."""
    return (x + 0.5).floor_().clamp_(0, 255)


def crop_resize_flip(images: Sequence[torch.Tensor], boxes: np.ndarray, flips: np.ndarray,
                     size: int) -> torch.Tensor:
    """Crop ``boxes`` (left, top, width, height; fractional allowed) out of 3 x H x W uint8
    ``images``, resize each to ``size`` x ``size`` (bilinear, antialiased), mirror where ``flips``:
    an N x 3 x size x size uint8 batch, on the images' device.

    The kernels run per filter tap, never per image: the images are laid end
    to end once; the horizontal pass gathers each tap's column for every
    output of every image (the rows the vertical pass needs only, so only the
    crops' regions are read), the vertical pass each tap's row of that result.
    """
    if not len(images):
        raise ValueError("an empty batch")
    device = images[0].device
    heights = np.array([im.shape[1] for im in images], np.int64)
    widths = np.array([im.shape[2] for im in images], np.int64)
    boxes = np.asarray(boxes, np.float64)
    top, rows = _rows(boxes[:, 1], boxes[:, 3], heights, size)

    flat = torch.cat([im.reshape(-1) for im in images])
    planes = heights * widths
    offsets = np.concatenate([[0], np.cumsum(3 * planes)[:-1]])
    host = np.concatenate([boxes, np.stack([widths, heights, top, offsets, planes], 1)], 1)
    box = torch.from_numpy(host).to(device)      # float64: exact for offsets below 2**53
    width, height, first_row = box[:, 4].long(), box[:, 5].long(), box[:, 6].long()
    offset, plane = box[:, 7].long(), box[:, 8].long()

    # Horizontal: (N, 3, rows, size), reading the crop's rows only; a flip reverses the outputs.
    columns, across_weights = resample_weights(box[:, 0], box[:, 2], box[:, 4], size, _taps(boxes[:, 2], size))
    mirror = torch.from_numpy(np.asarray(flips, bool)).to(device).view(-1, 1)
    columns = torch.where(mirror, columns.flip(1), columns)
    across_weights = torch.where(mirror.unsqueeze(-1), across_weights.flip(1), across_weights)
    source_rows = torch.minimum(first_row.view(-1, 1) + torch.arange(rows, device=device), height.view(-1, 1) - 1)
    row_start = (offset.view(-1, 1, 1, 1) + plane.view(-1, 1, 1, 1) * torch.arange(3, device=device).view(1, 3, 1, 1)
                 + (source_rows * width.view(-1, 1)).view(-1, 1, rows, 1))                  # N x 3 x rows x 1
    last_column = width.view(-1, 1, 1, 1) - 1
    across = torch.zeros((len(images), 3, rows, size), dtype=torch.float32, device=device)
    for k in range(across_weights.shape[-1]):
        column = torch.minimum(columns.view(-1, 1, 1, size) + k, last_column)
        across += flat[row_start + column].float() * across_weights[:, :, k].view(-1, 1, 1, size)
    across = _round_to_byte(across)                                                          # Pillow's 8-bit pass

    # Vertical: each tap's row of the horizontal pass, for every output row.
    row_first, down_weights = resample_weights(box[:, 1], box[:, 3], box[:, 5], size, _taps(boxes[:, 3], size))
    row_first = row_first - first_row.view(-1, 1)
    out = torch.zeros((len(images), 3, size, size), dtype=torch.float32, device=device)
    for k in range(down_weights.shape[-1]):
        pick = (row_first + k).clamp(max=rows - 1).view(-1, 1, size, 1).expand(-1, 3, size, size)
        out += across.gather(2, pick) * down_weights[:, :, k].view(-1, 1, size, 1)
    return _round_to_byte(out).to(torch.uint8)


class GpuDecoder:
    """A :class:`RawBatch` -> (N x 3 x size x size uint8 images, int64 labels), both on ``device``; ``size`` is
    the batch's own (an epoch's, under progressive resizing)."""

    def __init__(self, device: torch.device, path: str = "") -> None:
        self.device = torch.device(device)
        self.path = path

    def __call__(self, raw: RawBatch) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            images = decode_jpegs(raw.records, self.device)
        except RuntimeError as exc:
            from dimd.shuffle.decode import DecodeError

            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DecodeError(f"{self.path}: a record of this batch is not a JPEG nvJPEG decodes ({line})") from None
        pixels = crop_resize_flip(images, raw.boxes, raw.flips, raw.image_size)
        labels = torch.from_numpy(raw.labels).to(self.device, non_blocking=True)
        return pixels, labels
