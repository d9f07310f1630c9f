"""Random in-memory batches: a sampler over the local share, decoded by worker processes.

DIMD paper, section 4.1, "Random in-memory batch load". An epoch is the whole
data set seen once across the job, so every rank takes
``total // (world_size * batch_size)`` batches per epoch, drawn at random
without replacement from its own share. Each batch's augmentation is drawn
from one generator seeded with ``(seed, rank, epoch, step)``, so the batches
depend neither on the number of workers nor on their timing, and
``state_dict`` only needs the position to resume exactly.

The decoding happens in ``decode_workers`` processes (:mod:`dimd.shuffle.workers`):
they read the records zero-copy from the store's shared segment and write
each batch, split in one chunk per worker, into a ring of ``prefetch + 1``
shared batch slots; the training process only waits for a slot and copies it
out, or lends it (``borrow``: a GPU's feed copies straight from the slot,
page-locked with ``pin_memory``). So the decoding never takes the training
process's GIL.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

import numpy as np

from dimd.errors import DimdError
from dimd.format import crc32
from dimd.shuffle.crop import EVAL_CROP_RATIO, SCALE
from dimd.shuffle.memory import batch_memory
from dimd.shuffle.pinned import page_lock, page_unlock
from dimd.shuffle.shm import Segment
from dimd.shuffle.store import DistributedStore
from dimd.shuffle.streams import SAMPLER, stream
from dimd.shuffle.workers import DecodeTask, DecodeWorkers, int64_bytes

#: 2: the sampler's and the crops' random streams got their purpose word (dimd.shuffle.streams).
STATE_VERSION = 2


def too_few_for_a_batch(path: Any, records: int, ranks: int, batch_size: int) -> str | None:
    """Why ``records`` training records cannot give each of ``ranks`` ranks one batch, or None."""
    if records >= ranks * batch_size:
        return None
    return (f"{path}: {records} records are fewer than one batch per rank ({ranks} rank{'s' * (ranks != 1)} x "
            f"batch size {batch_size}); use a smaller batch")


class BatchLoader:
    """Iterate uint8 image batches (N x 3 x H x W) and int64 labels from a :class:`DistributedStore`.

    ``train=True``: random batches without replacement, random-resized crop and
    flip, ``steps_per_epoch`` identical on every rank. ``train=False``: every
    local record once, in order, the last batch possibly short, resize and
    centre crop; ``steps_per_epoch`` is then this rank's ``ceil(len(store) / b)``.
    ``crop_scale`` is the smallest share of the image area a training crop keeps.

    ``sizes``: progressive resizing, the training crop of each epoch (``sizes(epoch)`` px, at most
    ``image_size``, which the batch slots are sized for; e.g. a :class:`dimd.train.image_sizes.SizeSchedule`);
    an epoch's batches are decoded at its size. ``crop_ratio``: evaluation's centre crop over its resize
    (the shorter side is resized to ``image_size / crop_ratio``; torchvision's 224/256 by default).
    """

    def __init__(self, store: DistributedStore, batch_size: int, image_size: int = 224,
                 train: bool = True, decode_workers: int = 2, seed: int = 0, pin_memory: bool = False,
                 prefetch: int = 2, crop_scale: float = SCALE[0], sizes: Callable[[int], int] | None = None,
                 crop_ratio: float = EVAL_CROP_RATIO) -> None:
        for name, value in (("batch size", batch_size), ("image size", image_size),
                            ("decode workers", decode_workers), ("prefetch", prefetch)):
            if value < 1:
                raise DimdError(f"{name} must be at least 1 (got {value})")
        if seed < 0:
            raise DimdError(f"seed must be non-negative (got {seed})")
        if not 0 < crop_scale <= 1:
            raise DimdError(f"crop scale must be in (0, 1] (got {crop_scale})")
        if not 0 < crop_ratio <= 1:
            raise DimdError(f"crop ratio must be in (0, 1]: the centre crop over the resized shorter side "
                            f"(got {crop_ratio})")
        self.crop_ratio = crop_ratio
        self.sizes = sizes
        self.crop_scale = (crop_scale, 1.0)
        self.store = store
        self.batch_size = batch_size
        self.image_size = image_size
        self.train = train
        self.decode_workers = decode_workers
        self.seed = seed
        self.prefetch = prefetch
        self.rank = store.comm.Get_rank()
        self.world_size = store.comm.Get_size()
        if train:
            self.steps_per_epoch = store.total // (self.world_size * batch_size)
            problem = too_few_for_a_batch(store.path, store.total, self.world_size, batch_size)
            if problem:
                raise DimdError(problem)
        else:
            self.steps_per_epoch = -(-len(store) // batch_size)
        self._pin = pin_memory and _cuda_available()
        self._epoch, self._step = 0, 0  # the position: batches consumed so far
        self._pool: DecodeWorkers | None = None
        self._ring: Segment | None = None
        self._slots = prefetch + 1
        self._store_key: int | None = None          # the store segment the workers have mapped
        self._abandoned: list[tuple[int, int]] = []  # (worker, ticket) of batches left unread
        self._open: _Iteration | None = None         # the iteration (epoch() generator) now open
        self._in_flight: collections.deque[_Batch] = collections.deque()   # its batches submitted, not read

    # -- the sampler ----------------------------------------------------------------------

    def epoch_indices(self, epoch: int) -> list[np.ndarray]:
        """The local record indices of every batch of ``epoch``, in order."""
        n, b = len(self.store), self.batch_size
        if not self.train:
            return np.array_split(np.arange(n), np.arange(b, n, b)) if n else []
        take = self.steps_per_epoch * b
        if take > n:
            raise DimdError(f"rank {self.rank} holds {n} records, fewer than the {take} an epoch "
                            f"takes from it; the store is unbalanced")
        order = stream(SAMPLER, self.seed, self.rank, epoch).permutation(n)[:take]
        return list(order.reshape(self.steps_per_epoch, b))

    def image_size_at(self, epoch: int) -> int:
        """The size ``epoch``'s batches are decoded at: ``sizes(epoch)`` when training with ``sizes``, else
        ``image_size``."""
        if self.sizes is None or not self.train:
            return self.image_size
        size = int(self.sizes(epoch))
        if not 8 <= size <= self.image_size:
            raise DimdError(f"epoch {epoch}'s image size {size} px is outside 8..{self.image_size} px (the "
                            f"loader's image_size, which its batch slots are sized for)")
        return size

    # -- iteration ------------------------------------------------------------------------

    def epoch(self, epoch: int, stop: int | None = None, *,
              borrow: bool = False) -> Generator[tuple[Any, Any], None, None]:
        """Yield ``(images, labels)`` for ``epoch``.

        The loader has a position (epoch, batches consumed): asking for the
        epoch it is in continues from there (after a ``break``, a shuffle of
        the store, or :meth:`load_state_dict`); any other epoch starts at its
        first batch. A finished epoch moves the position to the next one.
        ``stop``: only the batches before batch ``stop``, and none decoded past
        it (a ``break`` wastes the batches already prefetched); the position
        then stays in the epoch. ``borrow``: the images are views of the
        ring's slot, not copies, valid until the next batch is asked for
        (with ``pin_memory`` the ring is page-locked, so a GPU copies from
        the slot itself: the device feed does this).
        """
        if epoch < 0:
            raise DimdError(f"epoch must be non-negative (got {epoch})")
        first = self._step if epoch == self._epoch else 0
        self._epoch, self._step = epoch, first
        batches = self.epoch_indices(epoch)
        size = self.image_size_at(epoch)
        end = len(batches) if stop is None else min(stop, len(batches))
        self._end_open_iteration("this loader's epoch() was called again while this iteration was still open, "
                                 "and the new one took over its batch slots; iterate one epoch at a time, or "
                                 "use a second BatchLoader")
        self._prepare()
        pending = self._in_flight = collections.deque()
        self._open = iteration = _Iteration()
        next_step = first
        try:
            for step in range(first, end):
                self._map_store()   # a shuffle within the epoch may have grown the store's segment
                if pending and pending[0].stale:   # a shuffle moved the records under them: read them again
                    pending = self._in_flight = collections.deque(
                        self._submit(epoch, batch.step, batch.indices, size) for batch in pending)
                # the ring's slots bound the batches in flight (prefetch may grow during an epoch)
                while next_step < end and next_step < step + self._slots:
                    pending.append(self._submit(epoch, next_step, batches[next_step], size))
                    next_step += 1
                images, labels = self._collect(pending.popleft(), borrow)
                self._epoch, self._step = epoch, step + 1
                yield images, labels
                if iteration.ended_because:
                    raise DimdError(iteration.ended_because)
            if end == len(batches):
                self._epoch, self._step = epoch + 1, 0
        finally:
            if self._open is iteration:
                self._end_open_iteration("")

    def _end_open_iteration(self, why: str) -> None:
        """End the open iteration, if any (``why``: what it raises should it go on); its batches in flight
        are left to be waited out, as they still write into the ring."""
        if self._open is not None:
            self._open.ended_because = why
        for batch in self._in_flight:
            self._abandoned.extend(batch.tickets)
        self._in_flight, self._open = collections.deque(), None

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches of it consumed so far)."""
        return self._epoch, self._step

    def seek(self, epoch: int, step: int = 0) -> None:
        """Move to batch ``step`` of ``epoch``: the next ``epoch(epoch)`` starts there.

        The batches are the same as a loader that got there by iterating
        (they depend only on seed, rank, epoch and step), provided the store
        holds the same records in the same order.
        """
        if epoch < 0 or not 0 <= step <= self.steps_per_epoch:
            raise DimdError(f"cannot seek to epoch {epoch}, batch {step} (an epoch has "
                            f"{self.steps_per_epoch} batches)")
        self._epoch, self._step = int(epoch), int(step)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self.epoch(self._epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch

    # -- the workers ----------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """The decoding processes' ids (started at the first batch asked for)."""
        return self._pool.pids if self._pool is not None else []

    @property
    def startup_seconds(self) -> float | None:
        """How long the workers took to start (None before they are started)."""
        return self._pool.startup_seconds if self._pool is not None else None

    def _prepare(self) -> None:
        """Start (or reuse) the workers, wait out abandoned batches, and point the workers at the store."""
        if self._pool is None or self._pool.closed:
            self._pool = DecodeWorkers.shared(self.decode_workers)
            self._drop_ring()
            self._store_key = None
        for worker, ticket in self._abandoned:
            self._pool.discard(worker, ticket)
        self._abandoned = []
        if self._ring is not None and self._slots != self.prefetch + 1:   # prefetch was changed: a ring to fit
            self._pool.detach(self._ring.key)
            self._drop_ring()
        if self._ring is None:
            self._slots = self.prefetch + 1
            self._ring = Segment(self._slots * self._slot_bytes, "dimd-ring")
            if self._pin:
                page_lock(self._ring)
            self._pool.attach(self._ring)
        self._map_store()

    def _map_store(self) -> None:
        """Have the workers map the store's segment: at the first batch, and after a shuffle grew it."""
        assert self._pool is not None
        segment = self.store.segment if self._paths is None else None
        if segment is not None and segment.key != self._store_key:
            self._let_go_of_store()
            self._pool.attach(segment)
            self._store_key = segment.key
            if self._finish_reading_store not in self.store.on_change:
                self.store.on_change.append(self._finish_reading_store)

    def _finish_reading_store(self, *_: object) -> None:
        """Before a shuffle moves the store's bytes: drop the batches in flight, and wait until the workers
        have done every task sent so far.

        The dropped batches are decoded again from the shuffled store when the
        iteration goes on, so every batch after the shuffle is the one a loader
        started on the shuffled store gives: a ``state_dict()`` taken there
        resumes exactly.
        """
        for batch in self._in_flight:
            self._abandoned.extend(batch.tickets)
            batch.tickets, batch.stale = [], True
        if self._pool is None or self._pool.closed:
            return
        for worker, ticket in self._abandoned:
            self._pool.discard(worker, ticket)
        self._abandoned = []
        self._pool.finish_tasks()

    def _let_go_of_store(self) -> None:
        """Unmap the store's segment in the workers (after the tasks sent before): it grew, or we close."""
        if self._pool is None or self._pool.closed or self._store_key is None:
            return
        for worker, ticket in self._abandoned:
            self._pool.discard(worker, ticket)
        self._abandoned = []
        self._pool.detach(self._store_key)
        self._store_key = None

    @property
    def _slot_bytes(self) -> int:
        return self.batch_size * 3 * self.image_size * self.image_size

    @property
    def _paths(self) -> Any:
        """``--read-from files``: the source's ``record_paths(indices)``; None for the in-memory store."""
        return getattr(self.store, "record_paths", None)

    def _submit(self, epoch: int, step: int, indices: np.ndarray, size: int) -> "_Batch":
        assert self._pool is not None and self._ring is not None
        n, store, paths = len(indices), self.store, self._paths
        slot = step % self._slots
        draw_key = (self.seed, self.rank, epoch, step) if self.train else None
        offsets, lengths = (None, None) if paths is not None else store.locate(indices)
        crcs = None if paths is not None else store.crc32[indices]
        records = store.global_index[indices]
        labels = store.labels[indices].astype(np.int64)
        tickets, parts = [], min(self.decode_workers, n)
        for k in range(parts):   # one chunk per worker (plain ints: this runs once per batch, on the rank)
            lo, hi = n * k // parts, n * (k + 1) // parts
            task = DecodeTask(ring=self._ring.key, slot_offset=slot * self._slot_bytes, count=n, lo=lo, hi=hi,
                              image_size=size, train=self.train, scale=self.crop_scale, crop_ratio=self.crop_ratio,
                              draw_key=draw_key,
                              source=self._store_key if paths is None else None,
                              offsets=None if offsets is None else int64_bytes(offsets[lo:hi]),
                              lengths=None if lengths is None else int64_bytes(lengths[lo:hi]),
                              crcs=None if crcs is None else int64_bytes(crcs[lo:hi]),
                              paths=paths(indices[lo:hi]) if paths is not None else None,
                              cold=bool(getattr(store, "cold", False)),
                              records=int64_bytes(records[lo:hi]), data_path=str(store.path))
            worker = (step + k) % self.decode_workers
            tickets.append((worker, self._pool.submit(worker, task)))
        return _Batch(step, slot, indices, labels, tickets, size)

    def _collect(self, batch: "_Batch", borrow: bool) -> tuple[Any, Any]:
        """Wait for ``batch``'s chunks, then hand its slot out: a copy (the slot is free again at once)
        or, ``borrow``ed, the slot itself (free again when the next batch is asked for)."""
        import torch

        self._wait_for(batch)
        assert self._ring is not None
        n, size = len(batch.indices), batch.size
        start = batch.slot * self._slot_bytes
        ready = self._ring.array[start : start + n * 3 * size * size].reshape(n, 3, size, size)
        images = torch.from_numpy(ready) if borrow else self._copy_out(ready)
        return images, torch.from_numpy(batch.labels)

    def _wait_for(self, batch: "_Batch") -> None:
        assert self._pool is not None
        for position, (worker, ticket) in enumerate(batch.tickets):
            try:
                self._pool.wait(worker, ticket)
            except DimdError:
                self._abandoned.extend(batch.tickets[position + 1:])
                raise

    def _copy_out(self, ready: np.ndarray) -> Any:
        """The images of a finished slot, copied (into pinned memory when a GPU is fed)."""
        import torch

        if self._pin:
            images = torch.empty(ready.shape, dtype=torch.uint8, pin_memory=True)
            np.copyto(images.numpy(), ready)
            return images
        return torch.from_numpy(ready.copy())

    def close(self) -> None:
        """Let go of the workers (the last loader using them ends them) and of the batch slots."""
        self._end_open_iteration("the loader was closed while this iteration was still open; a new "
                                 "epoch() starts the workers again and continues from the same batch")
        pool = self._pool
        if self._finish_reading_store in self.store.on_change:
            self.store.on_change.remove(self._finish_reading_store)
        if pool is None:
            return
        try:
            self._let_go_of_store()
            if self._ring is not None and not pool.closed:
                pool.detach(self._ring.key)
        except DimdError:
            pass   # a worker died: the pool is closed already
        finally:
            self._pool, self._abandoned, self._store_key = None, [], None
            pool.release()
            self._drop_ring()

    def _drop_ring(self) -> None:
        if self._ring is not None:
            if self._pin:
                page_unlock(self._ring)
            self._ring.close()
            self._ring = None

    def __enter__(self) -> "BatchLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            try:
                self.close()
            except Exception:  # during interpreter shutdown; the workers end with our sockets anyway
                pass

    # -- resume ---------------------------------------------------------------------------

    def _fingerprint(self) -> int:
        """Which records this rank holds, in which order (a shuffle changes it)."""
        return crc32(np.ascontiguousarray(self.store.global_index).view(np.uint8))

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, batches consumed) and what it depends on; plain Python values."""
        return {"version": STATE_VERSION, "epoch": self._epoch, "step": self._step, "seed": self.seed,
                "rank": self.rank, "world_size": self.world_size, "train": self.train,
                "batch_size": self.batch_size, "records": len(self.store),
                "store_round": self.store.round, "store_fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken: ``epoch(state['epoch'])`` resumes mid-way.

        The store must hold the same records in the same order: load it the
        same way and replay the last ``shuffle(seed, round)`` first.
        """
        if state.get("version") != STATE_VERSION:
            raise DimdError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        for key in ("seed", "rank", "world_size", "train", "batch_size"):
            if state[key] != getattr(self, key):
                raise DimdError(f"loader state was saved with {key}={state[key]!r}, this loader has "
                                f"{getattr(self, key)!r}")
        if state["records"] != len(self.store) or state["store_fingerprint"] != self._fingerprint():
            raise DimdError(f"loader state was saved when rank {self.rank} held other records (store "
                            f"round {state['store_round']}, now {self.store.round}); load the store and "
                            f"replay its last shuffle(seed, round) before resuming")
        if not 0 <= state["step"] <= self.steps_per_epoch:
            raise DimdError(f"loader state step {state['step']} is outside 0..{self.steps_per_epoch}")
        self.seek(int(state["epoch"]), int(state["step"]))


def open_loader(path: str, comm: Any, batch_size: int, *, image_size: int = 224, train: bool = True,
                decode_workers: int = 2, seed: int = 0, groups: int = 1, memory_limit: int | None = None,
                crop_scale: float | None = None, sizes: Callable[[int], int] | None = None,
                crop_ratio: float = EVAL_CROP_RATIO) -> BatchLoader:
    """Collective: load this rank's share of the packed set at ``path`` into memory and return its loader.

    The :class:`BatchLoader` yields uint8 ``N x 3 x H x W`` images
    and int64 labels: ``len(loader)`` batches per epoch (the same on every
    rank when ``train``), ``loader.epoch(e)`` the batches of epoch ``e``,
    ``state_dict()``/``load_state_dict()`` to resume mid-epoch,
    ``loader.store.classes`` the class names. A training set is shuffled across
    the ranks once (round 0, as ``dimd train`` does): loaded in order, each
    rank would hold a few classes of a class-sorted pack. ``train=False`` yields every
    local record once (each rank its share; sum the counts over ranks).
    ``sizes``: each epoch's training crop (progressive resizing, each at most ``image_size``);
    ``crop_ratio``: evaluation's centre crop over its resized shorter side (224/256).
    Normalise on the device with :class:`dimd.Normalize`.
    """
    store = DistributedStore.load(path, comm, groups=groups, memory_limit=memory_limit, decode_workers=decode_workers,
                                  batch_bytes=batch_memory(batch_size, image_size, 3, decode_workers))
    if train:   # MPI: round 0, as dimd train: in load order a rank's share is a few classes of a class-sorted pack
        store.shuffle(seed, 0)
    extra: dict[str, Any] = {} if crop_scale is None else {"crop_scale": crop_scale}
    return BatchLoader(store, batch_size, image_size, train=train, decode_workers=decode_workers, seed=seed,
                       pin_memory=_cuda_available(), sizes=sizes, crop_ratio=crop_ratio, **extra)


@dataclass
class _Iteration:
    """One ``epoch()`` generator; ended from outside (a second one, ``close``), it raises ``ended_because``."""

    ended_because: str = ""


@dataclass
class _Batch:
    """A batch on its way: its ring slot, its records, their labels and the (worker, ticket) of each chunk."""

    step: int
    slot: int
    indices: np.ndarray
    labels: np.ndarray
    tickets: list[tuple[int, int]]
    size: int             # px: the epoch's
    stale: bool = False   # a shuffle moved its records before it was read: decode it again


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
