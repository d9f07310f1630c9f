"""Batches that are already on the device when the step asks: the next one moves while this one trains.

:class:`DeviceFeed` wraps a :class:`dimd.shuffle.BatchLoader` and has its
interface (``epoch``, ``position``, ``seek``, ``state_dict``...). When the
step asks for batch k, the feed first takes batch k+1 from the loader and
starts moving it to the GPU on a copy stream of its own (``non_blocking``
from the loader's pinned memory), then hands over batch k, whose copy was
started one step earlier: the compute stream waits for it on the GPU, and
the Python thread does not wait at all. With ``--decode gpu`` the "move" is
nvJPEG's decode and the crops (:mod:`dimd.shuffle.gpu_decode`), on the same
side stream.

Being one batch ahead must not change what a checkpoint records, so the
feed's ``position`` and ``state_dict`` count the batches handed over, not the
ones taken from the loader, and a feed closed mid-epoch moves the loader back
to what was handed over (the batches depend only on the position, so the one
taken ahead comes again). Before it takes another batch from the loader, the
feed waits until the previous one's copy has finished, so a loader may reuse
a batch's host memory as soon as it is asked for the next batch.

On the CPU there is nothing to move: the batches pass through unchanged, and
only the bookkeeping runs (tested there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Staged:
    batch: Batch
    done: Any                       # a CUDA event recorded after the batch's copy, or None
    position: tuple[int, int]       # the loader's position once this batch is handed over

    def wait_copied(self) -> None:
        """The host side: the copy has read its source (the loader may reuse that memory)."""
        if self.done is not None:
            self.done.synchronize()


def to_device(device: torch.device) -> Callable[[Any], Batch]:
    """The stage of ``--decode cpu``: a pinned uint8 batch and its labels, copied without blocking."""
    def stage(batch: Any) -> Batch:
        images, labels = batch
        return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    return stage


class DeviceFeed:
    """A loader whose batches arrive on ``device`` one step ahead (see the module's docstring).

    ``source(epoch)`` yields the loader's host batches (default: its own
    ``epoch``); ``stage`` turns one into a device batch (default: a
    non-blocking copy). On a CPU device with the default stage, batches pass
    through.
    """

    def __init__(self, loader: Any, device: torch.device, *,
                 source: Callable[[int], Generator[Any, None, None]] | None = None,
                 stage: Callable[[Any], Batch] | None = None) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.source = source or loader.epoch
        on_cuda = self.device.type == "cuda"
        self.stage = stage or (to_device(self.device) if on_cuda else (lambda batch: batch))
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._handed: tuple[int, int] | None = None    # the position while an epoch is being fed

    # -- the loader's interface, counted in batches handed over ------------------------------

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches of it handed over so far)."""
        return self._handed if self._handed is not None else self.loader.position

    def seek(self, epoch: int, step: int = 0) -> None:
        self._handed = None
        self.loader.seek(epoch, step)

    def state_dict(self) -> dict[str, Any]:
        state = self.loader.state_dict()
        state["epoch"], state["step"] = self.position
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._handed = None
        self.loader.load_state_dict(state)

    @property
    def prefetch(self) -> int:
        return self.loader.prefetch

    @prefetch.setter
    def prefetch(self, batches: int) -> None:
        self.loader.prefetch = batches

    def __getattr__(self, name: str) -> Any:       # steps_per_epoch, store, batch_size, ...
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        self.loader.close()

    # -- feeding -------------------------------------------------------------------------

    def epoch(self, epoch: int) -> Generator[Batch, None, None]:
        """Yield ``epoch``'s batches on the device, continuing from the position as the loader does."""
        inner = self.source(epoch)
        pending: _Staged | None = None
        finished = False
        try:
            for host in inner:
                staged = self._stage(host, self.loader.position)
                del host
                if pending is not None:
                    yield self._hand_over(pending)
                pending = staged
                pending.wait_copied()      # before the loader is asked again (it may reuse the memory)
            if pending is not None:
                yield self._hand_over(pending)
            finished = True
        finally:
            inner.close()
            if self._handed is not None and not finished:
                self.loader.seek(*self._handed)   # a batch taken ahead comes again
            self._handed = None

    def _stage(self, host: Any, position: tuple[int, int]) -> _Staged:
        if self.stream is None:
            return _Staged(self.stage(host), None, position)
        with torch.cuda.stream(self.stream):
            batch = self.stage(host)
            done = torch.cuda.Event()
            done.record(self.stream)
        return _Staged(batch, done, position)

    def _hand_over(self, staged: _Staged) -> Batch:
        self._handed = staged.position
        if staged.done is None:
            return staged.batch
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(staged.done)             # the GPU waits for the copy; Python does not
        for tensor in staged.batch:
            tensor.record_stream(compute)           # made on the copy stream, freed after compute uses it
        return staged.batch


def device_feed(loader: Any, device: torch.device, decode: str = "cpu") -> DeviceFeed:
    """``dimd train``'s feed: the loader's pinned batches copied ahead (``decode`` cpu), or its records'
    bytes decoded by nvJPEG and cropped on the device, ahead (``decode`` gpu)."""
    if decode == "cpu":
        return DeviceFeed(loader, device)
    from dimd.shuffle.gpu_decode import GpuDecoder
    from dimd.shuffle.raw_batches import raw_batches

    return DeviceFeed(loader, device, source=lambda epoch: raw_batches(loader, epoch),
                      stage=GpuDecoder(device, loader.image_size, str(loader.store.path)))
