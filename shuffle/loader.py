"""Random in-memory batches: a sampler over the local share and a pool of decoding threads.

DIMD paper, section 4.1, "Random in-memory batch load". An epoch is the whole
data set seen once across the job, so every rank takes
``total // (world_size * batch_size)`` batches per epoch, drawn at random
without replacement from its own share. Each batch and each image's
augmentation come from a seed derived from ``(seed, rank, epoch, step)``, so
the batches do not depend on thread timing, and ``state_dict`` only needs the
position to resume exactly.

PIL releases the GIL while it decodes and resizes, so threads scale; the
pool keeps ``prefetch`` batches in flight ahead of the consumer.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generator, Iterator

import numpy as np

from dimd.errors import DimdError
from dimd.format import crc32
from dimd.shuffle.decode import SCALE, DecodeError, eval_hwc, to_chw, train_hwc
from dimd.shuffle.store import DistributedStore

STATE_VERSION = 1


class BatchLoader:
    """Iterate uint8 image batches (N x 3 x H x W) and int64 labels from a :class:`DistributedStore`.

    ``train=True``: random batches without replacement, random-resized crop and
    flip, ``steps_per_epoch`` identical on every rank. ``train=False``: every
    local record once, in order, the last batch possibly short, resize and
    centre crop; ``steps_per_epoch`` is then this rank's ``ceil(len(store) / b)``.
    ``crop_scale`` is the smallest share of the image area a training crop keeps.
    """

    def __init__(self, store: DistributedStore, batch_size: int, image_size: int = 224,
                 train: bool = True, workers: int = 2, seed: int = 0, pin_memory: bool = False,
                 prefetch: int = 2, crop_scale: float = SCALE[0]) -> None:
        for name, value in (("batch size", batch_size), ("image size", image_size),
                            ("workers", workers), ("prefetch", prefetch)):
            if value < 1:
                raise DimdError(f"{name} must be at least 1 (got {value})")
        if seed < 0:
            raise DimdError(f"seed must be non-negative (got {seed})")
        if not 0 < crop_scale <= 1:
            raise DimdError(f"crop scale must be in (0, 1] (got {crop_scale})")
        self.crop_scale = (crop_scale, 1.0)
        self.store = store
        self.batch_size = batch_size
        self.image_size = image_size
        self.train = train
        self.workers = workers
        self.seed = seed
        self.prefetch = prefetch
        self.rank = store.comm.Get_rank()
        self.world_size = store.comm.Get_size()
        if train:
            self.steps_per_epoch = store.total // (self.world_size * batch_size)
            if self.steps_per_epoch == 0:
                raise DimdError(f"{store.path}: {store.total} records are fewer than one batch per rank "
                                f"({self.world_size} ranks x batch size {batch_size}); use a smaller batch")
        else:
            self.steps_per_epoch = -(-len(store) // batch_size)
        self._pin = pin_memory and _cuda_available()
        self._epoch, self._step = 0, 0  # the position: batches consumed so far
        self._pool: ThreadPoolExecutor | None = None

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
        order = np.random.default_rng([self.seed, self.rank, epoch]).permutation(n)[:take]
        return list(order.reshape(self.steps_per_epoch, b))

    # -- iteration ------------------------------------------------------------------------

    def epoch(self, epoch: int) -> Generator[tuple[Any, Any], None, None]:
        """Yield ``(images, labels)`` for ``epoch``.

        The loader has a position (epoch, batches consumed): asking for the
        epoch it is in continues from there (after a ``break``, a shuffle of
        the store, or :meth:`load_state_dict`); any other epoch starts at its
        first batch. A finished epoch moves the position to the next one.
        """
        if epoch < 0:
            raise DimdError(f"epoch must be non-negative (got {epoch})")
        first = self._step if epoch == self._epoch else 0
        self._epoch, self._step = epoch, first
        batches = self.epoch_indices(epoch)
        pool = self._executor()
        pending: collections.deque = collections.deque()
        next_step = first
        try:
            for step in range(first, len(batches)):
                while next_step < len(batches) and next_step <= step + self.prefetch:
                    pending.append(self._submit(pool, epoch, next_step, batches[next_step]))
                    next_step += 1
                images, labels, futures = pending.popleft()
                for future in futures:
                    future.result()
                self._epoch, self._step = epoch, step + 1
                yield images, labels
            self._epoch, self._step = epoch + 1, 0
        finally:
            for _, _, futures in pending:
                for future in futures:
                    future.cancel()

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

    def _submit(self, pool: ThreadPoolExecutor, epoch: int, step: int,
                indices: np.ndarray) -> tuple[Any, Any, list[Future]]:
        import torch

        size = self.image_size
        images = torch.empty((len(indices), 3, size, size), dtype=torch.uint8, pin_memory=self._pin)
        labels = torch.from_numpy(self.store.labels[indices].astype(np.int64))
        target = images.numpy()
        seeds = image_seeds(self.seed, self.rank, epoch, step, len(indices)) if self.train else [None] * len(indices)
        chunks = np.array_split(np.arange(len(indices)), min(self.workers, len(indices)))
        futures = [pool.submit(self._decode_into, target, indices, seeds, chunk) for chunk in chunks]
        return images, labels, futures

    def _decode_into(self, target: np.ndarray, indices: np.ndarray, seeds: list, chunk: np.ndarray) -> None:
        store, size = self.store, self.image_size
        for slot in chunk.tolist():
            i = int(indices[slot])
            try:
                if self.train:
                    hwc, flip = train_hwc(store.record(i), size, np.random.default_rng(seeds[slot]),
                                          self.crop_scale)
                    to_chw(hwc, flip, out=target[slot])
                else:
                    to_chw(eval_hwc(store.record(i), size), out=target[slot])
            except DecodeError as exc:
                raise DecodeError(f"{store.path}: record {int(store.global_index[i])}: {exc}") from None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="dimd-decode")
        return self._pool

    def close(self) -> None:
        """Stop the decoding threads (also done when the loader is garbage-collected)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "BatchLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

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


def image_seeds(seed: int, rank: int, epoch: int, step: int, n: int) -> list[np.random.SeedSequence]:
    """The seeds of a training batch's ``n`` augmentations: they depend on nothing but the position."""
    return np.random.SeedSequence([seed, rank, epoch, step]).spawn(n)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
