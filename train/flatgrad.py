"""Every gradient in one contiguous buffer, so one allreduce (or a few buckets) moves them all.

Each parameter's ``.grad`` is a view into :attr:`FlatGradients.buffer`;
autograd accumulates into an existing gradient in place, so backward writes
straight into the buffer and the allreduce needs no gather or scatter copies
(the idea of DDP's ``gradient_as_bucket_view``). A short tail after the
gradients carries per-step scalars (loss sum, correct count, a stop flag) in
the same message, so they cost no extra collective.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import torch

#: Sums a flat buffer in place over the ranks (``dimd.allreduce.allreduce`` on a communicator, or an
#: identity on one process): what S-SGD's gradients, SMA's Delta and the batch-norm recompute are given.
Reduce = Callable[[np.ndarray], None]


class FlatGradients:
    """One buffer: ``[grad_0 | grad_1 | ... | grad_n | extras]``, float32."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], *, extras: int = 0,
                 bucket_bytes: int = 0, first_bucket_bytes: int = 0, dtype: torch.dtype = torch.float32,
                 host_copy: bool = True) -> None:
        """``host_copy``: on a GPU, keep a pinned host copy for dimd's allreduces, which sum CPU buffers
        (False: the buffer is reduced where it is, on the device). ``first_bucket_bytes``: see
        :func:`bucket_bounds`."""
        self.parameters = [p for p in parameters if p.requires_grad]
        if not self.parameters:
            raise ValueError("the model has no trainable parameters")
        device = self.parameters[0].device
        for p in self.parameters:
            if p.dtype != dtype or p.device != device or not _dense(p):
                raise ValueError(f"flat gradients need dense {dtype} parameters on one device, "
                                 f"got {p.dtype} {tuple(p.shape)} on {p.device}")
        sizes = np.array([p.numel() for p in self.parameters], np.int64)
        ends = np.cumsum(sizes)
        self.offsets = ends - sizes
        self.numel = int(ends[-1])
        self.buffer = torch.zeros(self.numel + extras, dtype=dtype, device=device)
        self.grads = self.buffer[: self.numel]
        self.extras = self.buffer[self.numel:]
        # On a GPU the allreduce runs on a pinned host copy (dimd.allreduce sums CPU buffers).
        self._host = (self.buffer if device.type == "cpu" or not host_copy else
                      torch.empty(self.buffer.shape, dtype=dtype, pin_memory=True))
        self.host_array: np.ndarray | None = self._host.numpy() if self._host.device.type == "cpu" else None
        self.bucket_bounds = bucket_bounds(ends, self.numel + extras, bucket_bytes, self.buffer.element_size(),
                                           first_bucket_bytes)
        self.attach()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def attach(self) -> None:
        """Point every ``.grad`` at its slice of the buffer (again, if something replaced it), laid out
        as its parameter is (a channels-last weight gets a channels-last gradient: autograd adds in place)."""
        for p, offset in zip(self.parameters, self.offsets):
            p.grad = self.buffer.as_strided(p.shape, p.stride(), int(offset)) if p.requires_grad else None

    def attached(self) -> bool:
        """Whether every ``.grad`` still lives in the buffer (autograd accumulates in place)."""
        base = self.buffer.data_ptr()
        size = self.buffer.element_size()
        return all(p.grad is not None and p.grad.data_ptr() == base + int(offset) * size
                   for p, offset in zip(self.parameters, self.offsets) if p.requires_grad)

    def zero(self) -> None:
        self.buffer.zero_()

    def allreduce(self, reduce: Reduce, world_size: int) -> None:
        """Sum the buffer across ranks with ``reduce`` (bucket by bucket), then average the gradients.

        ``reduce`` sums a contiguous float32 numpy array in place across the
        job. The extras tail is summed, not averaged.
        """
        if not self.attached():
            raise RuntimeError("a gradient left the flat buffer (was zero_grad(set_to_none=True) called?)")
        if self.host_array is None:
            raise RuntimeError("these flat gradients have no host copy to reduce (made with host_copy=False)")
        if self._host is not self.buffer:
            self._host.copy_(self.buffer)
        for start, stop in self.bucket_bounds:
            reduce(self.host_array[start:stop])
        if self._host is not self.buffer:
            self.buffer.copy_(self._host, non_blocking=False)
        if world_size > 1:
            self.grads.div_(world_size)


def _dense(p: torch.Tensor) -> bool:
    """Whether ``p`` fills exactly ``numel`` elements in some order: contiguous, or channels-last."""
    return p.is_contiguous() or (p.ndim == 4 and p.is_contiguous(memory_format=torch.channels_last))


def bucket_bounds(param_ends: Sequence[int] | np.ndarray, total: int, bucket_bytes: int,
                  itemsize: int, first_bytes: int = 0) -> list[tuple[int, int]]:
    """Split ``[0, total)`` into buckets of about ``bucket_bytes``, cut only at parameter ends.

    ``bucket_bytes <= 0`` means one bucket. ``first_bytes`` > 0 cuts the first
    bucket at about that size instead (DDP's rule: the last layers' bucket is
    ready early in backward, so its reduction starts while most of backward is
    still to run). The tail beyond the last parameter (the extras) joins the last
    bucket; a tail under a quarter of a bucket joins the one before it, unless
    that is the small first one.
    """
    first = min(first_bytes, bucket_bytes) if first_bytes > 0 else bucket_bytes
    if bucket_bytes <= 0 or total * itemsize <= first:
        return [(0, total)]
    limit = max(bucket_bytes // itemsize, 1)
    first_limit = max(first // itemsize, 1)
    bounds: list[tuple[int, int]] = []
    start = 0
    for end in np.asarray(param_ends, np.int64):
        if end - start >= (limit if bounds else first_limit):
            bounds.append((start, int(end)))
            start = int(end)
    if start < total:
        regular = len(bounds) > (1 if first_limit < limit else 0)   # a bucket of the full size to join
        if regular and total - start < limit // 4:
            bounds[-1] = (bounds[-1][0], total)   # no tiny trailing bucket
        else:
            bounds.append((start, total))
    return bounds
