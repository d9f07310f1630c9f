"""Batches that are already on the device when the step asks: a thread stages them while steps run.

:class:`DeviceFeed` wraps a :class:`dimd.shuffle.BatchLoader` and has its
interface (``epoch``, ``position``, ``seek``, ``state_dict``...). On a GPU a
feeding thread of the rank takes the loader's batches, starts each towards
the GPU on a copy stream of its own (``non_blocking``, straight from the
loader's page-locked ring of batch slots), and queues it ``ahead`` batches
in front of the step; the compute stream waits for a batch's copy on the GPU
(an event) and the step's thread does not wait at all. With ``--decode gpu``
the "copy" is nvJPEG's decode and the crops (:mod:`dimd.shuffle.gpu_decode`),
whose host-side work then also leaves the step's thread. The thread releases
the GIL while it waits (for the decoding workers, for a copy), and it never
calls MPI, so the rank stays ``MPI_THREAD_FUNNELED``.

Measured on an H100 with 14 decoding workers (``bench/probes/pinned_feed.py``, see
docs/gpu.md): copying each slot into pinned memory in the step's thread cost
it 3.9-5.5 ms per batch of 128 at 224 px; a page-locked ring costs none, and
the thread takes the rest of the hand-over off the step (0.2 ms left).

Running ahead must not change what a checkpoint records, so the feed's
``position`` and ``state_dict`` count the batches handed over, not the ones
taken from the loader, and a feed closed mid-epoch moves the loader back to
what was handed over (the batches depend only on the position, so the ones
taken ahead come again). Before it takes another batch from the loader, the
feed waits until the previous one's copy has read its host memory, so a
loader may reuse a batch's slot as soon as it is asked for the next batch.

On the CPU there is nothing to move: the batches pass through unchanged in
the caller's thread (``ahead=0``), and only the bookkeeping runs.

While the step's thread captures a CUDA graph, nothing else may issue device work that allocates or
synchronises (PyTorch's notes on CUDA graphs), and nvJPEG does both. So every batch's device work
(the copy or the decode, and the wait for it) holds :data:`DEVICE_WORK`, which a capture holds for
its whole length (:class:`dimd.train.graphs.StepGraphs`): the feed pauses during every capture, the
first and each one after the auto-tuner or a checkpoint reallocated what the graphs read.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

#: One batch: its images and their labels (on the device once the feed hands it over).
Batch = tuple[torch.Tensor, torch.Tensor]

#: Batches a GPU's feeding thread stages in front of the step (each holds its device memory meanwhile).
AHEAD_ON_GPU = 2

#: Held by one batch's device work in the feed, and by a CUDA graph's capture for its whole length: the
#: two never overlap (a capture waits for the batch being staged; the feed waits for the capture).
DEVICE_WORK = threading.Lock()


@dataclass
class _Staged:
    batch: Batch
    done: Any                       # a CUDA event recorded after the batch's copy, or None
    position: tuple[int, int]       # the loader's position once this batch is handed over

    def wait_copied(self) -> None:
        """The host side: the copy has read its source (the loader may reuse that memory)."""
        if self.done is not None:
            self.done.synchronize()     # a blocking-sync event: the thread sleeps, it does not spin


@dataclass
class _Failed:
    error: BaseException            # raised by the loader or the stage in the feeding thread


_END = object()


def to_device(device: torch.device) -> Callable[[Any], Batch]:
    """The stage of ``--decode cpu``: a pinned uint8 batch and its labels, copied without blocking."""
    def stage(batch: Any) -> Batch:
        images, labels = batch
        return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    return stage


class DeviceFeed:
    """A loader whose batches arrive on ``device`` ahead of the step (see the module's docstring).

    ``source(epoch)`` yields the loader's host batches (default: its own
    ``epoch``); ``stage`` turns one into a device batch (default: a
    non-blocking copy). ``ahead``: batches a feeding thread stages in front
    of the step (default :data:`AHEAD_ON_GPU` on a GPU, 0 on the CPU: no
    thread, each batch staged when asked). On a CPU device with the default
    stage, batches pass through.
    """

    def __init__(self, loader: Any, device: torch.device, *,
                 source: Callable[[int], Generator[Any, None, None]] | None = None,
                 stage: Callable[[Any], Batch] | None = None, ahead: int | None = None) -> None:
        self.loader = loader
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        if on_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())   # the feeding thread sets it
        self.source = source or loader.epoch
        self.stage = stage or (to_device(self.device) if on_cuda else (lambda batch: batch))
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.ahead = (AHEAD_ON_GPU if on_cuda else 0) if ahead is None else ahead
        if self.ahead < 0:
            raise ValueError(f"ahead must be at least 0 (got {self.ahead})")
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
        staged = self._staged_in_thread(epoch) if self.ahead else self._staged_here(epoch)
        finished = False
        try:
            for item in staged:
                yield self._hand_over(item)
            finished = True
        finally:
            staged.close()
            if self._handed is not None and not finished:
                self.loader.seek(*self._handed)   # batches taken ahead come again
            self._handed = None

    def _staged_here(self, epoch: int) -> Generator[_Staged, None, None]:
        inner = self.source(epoch)
        try:
            for host in inner:
                with DEVICE_WORK:           # never during a CUDA graph's capture
                    item = self._stage(host, self.loader.position)
                    del host
                    item.wait_copied()      # before the loader is asked again (it may reuse the memory)
                yield item
        finally:
            inner.close()

    def _staged_in_thread(self, epoch: int) -> Generator[_Staged, None, None]:
        """The staged batches of a feeding thread that runs ``ahead`` batches in front of the caller."""
        ready: queue.Queue[Any] = queue.Queue(self.ahead)
        stop = threading.Event()

        def offer(item: Any) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def feed() -> None:
            items = self._staged_here(epoch)
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)      # a new thread starts on device 0
                for item in items:
                    if not offer(item):
                        return
                offer(_END)
            except BaseException as exc:   # the loader's or the stage's error, raised again in the caller
                offer(_Failed(exc))
            finally:
                items.close()               # the loader's generator ends in the thread that ran it

        thread = threading.Thread(target=feed, name="dimd-device-feed", daemon=True)
        thread.start()
        try:
            while (item := self._next(ready, thread)) is not _END:
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            stop.set()
            thread.join()

    @staticmethod
    def _next(ready: queue.Queue, thread: threading.Thread) -> Any:
        """The feeding thread's next item; a thread gone without a word (never expected) is an error, not a hang."""
        while True:
            try:
                return ready.get(timeout=1.0)
            except queue.Empty:
                if not thread.is_alive() and ready.empty():
                    raise RuntimeError("the device feed's thread ended without handing over its batches") from None

    def _stage(self, host: Any, position: tuple[int, int]) -> _Staged:
        if self.stream is None:
            return _Staged(self.stage(host), None, position)
        with torch.cuda.stream(self.stream):
            batch = self.stage(host)
            done = torch.cuda.Event(blocking=True)
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
    """``dimd train``'s feed: the loader's batches copied ahead straight from its page-locked slots
    (``decode`` cpu), or its records' bytes decoded by nvJPEG and cropped on the device, ahead (``decode`` gpu)."""
    if decode == "cpu":
        if torch.device(device).type == "cuda":
            return DeviceFeed(loader, device, source=lambda epoch: loader.epoch(epoch, borrow=True))
        return DeviceFeed(loader, device)
    from dimd.shuffle.gpu_decode import GpuDecoder
    from dimd.shuffle.raw_batches import raw_batches

    return DeviceFeed(loader, device, source=lambda epoch: raw_batches(loader, epoch),
                      stage=GpuDecoder(device, str(loader.store.path)))
