"""The distributed in-memory store: partitioned load, zero-copy records, the group shuffle.

DIMD paper, section 4.1: each learner loads a share of the packed file into
memory; the learners of a group together hold every record once; a shuffle
moves records between the ranks of a group with one ``Alltoallv``.

Where a record lands after ``shuffle(seed, round)`` depends only on
``(seed, round, group)``, not on where it was before: a permutation of the
whole set assigns each record a slot, and slots are cut into balanced
contiguous ranges, one per rank. So every rank keeps ``total // size`` (+1)
records, and a resumed job reproduces the placement by loading and calling
``shuffle`` once with the same seed and round.

Lines that exist only because the program is distributed carry a ``# MPI:``
comment (the convention of the training engine too, after Horovod's
annotated examples): read without them, this is a plain in-memory data set.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dimd.errors import DimdError
from dimd.format import PackedDataset, crc32
from dimd.shuffle.exchange import (META_DTYPE, displacements, exchange_bytes, exchange_rows, gather_bytes,
                                   pack_down)
from dimd.shuffle.memory import WORKER_PRIVATE_BYTES
from dimd.shuffle.shm import Segment
from dimd.shuffle.streams import PLACEMENT, stream
from dimd.host import available_memory
from dimd.mpi import agree_or_raise, node_local_ranks
from dimd.shares import balanced_bounds
from dimd.shuffle.partition import MemoryNeed, memory_problem, split_groups

#: Bytes per read call of the load: few large reads, but a progress callback now and then.
READ_CHUNK = 64 << 20


def packed_record_count(comm: Any, path: str | os.PathLike, *also: str | os.PathLike) -> int:
    """Collective: the records of the packed set ``path``, read from its index by rank 0 for every rank.

    Cheap next to a load (the index only), so a job can check what depends on
    the set's size before it reads the data; ``also`` are sets that must open
    too. A set that does not open is every rank's error, as in the load.
    """
    count, problem = 0, None
    if comm.Get_rank() == 0:
        try:
            count = len(PackedDataset(path))
            for other in also:
                PackedDataset(other)
        except DimdError as exc:
            problem = str(exc)
    agree_or_raise(comm, problem)   # MPI: rank 0's problem stops every rank
    return int(comm.bcast(count, root=0))


@dataclass(frozen=True)
class ShuffleStats:
    """One rank's view of one shuffle (bytes and records exchanged with other ranks)."""

    round: int
    seconds: float
    group_size: int
    records_sent: int
    bytes_sent: int
    records_received: int
    bytes_received: int
    records_held: int
    bytes_held: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadStats:
    """One rank's partitioned load."""

    seconds: float
    records: int
    bytes: int
    reads: int
    first_record: int


class DistributedStore:
    """This rank's share of a packed data set, in one numpy buffer, plus its index rows.

    Build it with :meth:`load` (collective over ``comm``).
    """

    def __init__(self, *, path: Path, comm: Any, group_comm: Any, group: int, groups: int,
                 total: int, classes: list[str], data: Segment, starts: np.ndarray,
                 meta: np.ndarray, load_stats: LoadStats) -> None:
        self.path = path
        self.comm = comm
        self.group_comm = group_comm
        self.group = group
        self.groups = groups
        self.total = total
        self.classes = classes
        self.load_stats = load_stats
        self.round: int | None = None  # the last shuffle's round; None: still in load order
        #: Called before a shuffle moves the bytes of :attr:`segment` in place (on one rank: reorders the
        #: records): each must return only when no process reads the segment any more (a loader drops its
        #: batches in flight and waits for its workers' tasks).
        self.on_change: list[Callable[[Segment], None]] = []
        #: Private memory the leaving records are gathered into, kept from one shuffle to the next.
        self._send = np.empty(0, np.uint8)
        self._set(data, starts, meta)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, comm: Any, groups: int = 1, memory_limit: int | None = None,
             *, decode_workers: int = 0, batch_bytes: int = 0,
             advance: Callable[[int], None] | None = None) -> "DistributedStore":
        """Collective over ``comm``: split into ``groups`` groups, load this rank's contiguous share.

        Every rank checks, before reading, that its share (with the send
        buffer a shuffle needs, the private memory of the ``decode_workers``
        processes that will decode it, and ``batch_bytes`` for the loaders'
        batches: :func:`dimd.shuffle.memory.batch_memory`) fits its part of
        the node's available memory and ``memory_limit`` bytes; if any rank's
        does not, every rank raises :class:`DimdError`. The store itself is
        counted once: the workers map the rank's segment.
        ``advance(n)`` is called with bytes read.
        """
        start_time = time.perf_counter()
        group_comm = split_groups(comm, groups)             # MPI: the ranks that together hold the set
        dataset, problem = None, None
        try:
            dataset = PackedDataset(path)
        except DimdError as exc:
            problem = str(exc)
        agree_or_raise(comm, problem)                       # MPI: one rank's problem ends every rank
        assert dataset is not None
        agree_or_raise(comm, _other_sets(dataset, comm))    # MPI: every rank must read the same pack

        total = len(dataset)
        size, rank = group_comm.Get_size(), group_comm.Get_rank()
        bounds = balanced_bounds(total, size)                # MPI: this rank's share of the records
        first, stop = int(bounds[rank]), int(bounds[rank + 1])
        begin, end = dataset.byte_range(first, stop)
        rows = dataset.records[first:stop]
        share = end - begin
        # A shuffle packs the records that leave the rank beside the store (at most the share again), in
        # a buffer it keeps for the next shuffle.
        need = MemoryNeed(share_bytes=share * (2 if size > 1 else 1) + len(rows) * META_DTYPE.itemsize * 4,
                          worker_bytes=decode_workers * WORKER_PRIVATE_BYTES,   # each one's interpreter and buffers
                          batch_bytes=batch_bytes)
        budget = available_memory() // node_local_ranks(comm)   # MPI: the node's memory, shared by its ranks
        # MPI: every rank refuses if one must
        agree_or_raise(comm, memory_problem(need, budget=budget, memory_limit=memory_limit,
                                            rank=comm.Get_rank(), records=len(rows), decode_workers=decode_workers,
                                            group_size=size, groups=groups, path=str(dataset.data_path)))

        data, reads, problem = Segment(share, "dimd-store"), 0, None   # the decoding workers map it
        try:
            reads = _read_range(dataset.data_path, begin, data.array, advance)
            problem = _spot_check(dataset, first, rows, data.array, begin)
        except OSError as exc:
            problem = f"{dataset.data_path}: read failed ({exc})"
        agree_or_raise(comm, problem)                       # MPI: one rank's problem ends every rank

        meta = np.empty(len(rows), META_DTYPE)
        meta["index"] = np.arange(first, stop, dtype=np.int64)
        for field in ("label", "length", "crc32", "height", "width"):
            meta[field] = rows[field]
        starts = rows["offset"].astype(np.int64) - begin
        stats = LoadStats(seconds=time.perf_counter() - start_time, records=len(rows), bytes=share,
                          reads=reads, first_record=first)
        return cls(path=dataset.data_path, comm=comm, group_comm=group_comm,
                   group=comm.Get_rank() // size, groups=groups, total=total,
                   classes=list(dataset.classes), data=data, starts=starts, meta=meta,
                   load_stats=stats)

    def _set(self, data: Segment, starts: np.ndarray, meta: np.ndarray) -> None:
        #: The shared memory that holds the records (a new one after each shuffle between ranks).
        self.segment = data
        self._data = data.array[:]
        self._data.flags.writeable = False  # records are handed out as views: nobody may change them
        self._starts = np.ascontiguousarray(starts, np.int64)
        self._meta = meta
        self.labels = np.ascontiguousarray(meta["label"])
        self.global_index = np.ascontiguousarray(meta["index"])

    # -- access ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._meta)

    def record(self, i: int) -> memoryview:
        """The encoded bytes of local record ``i``, without copying (a view: a shuffle moves the bytes under it)."""
        start = int(self._starts[i])
        return self._data.data[start : start + int(self._meta["length"][i])]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte offsets in :attr:`segment`, lengths) of local records ``indices``."""
        return self._starts[indices], self._meta["length"][indices].astype(np.int64)

    @property
    def lengths(self) -> np.ndarray:
        return self._meta["length"]

    @property
    def crc32(self) -> np.ndarray:
        """The index's crc32 of each local record (what the bytes should hash to)."""
        return self._meta["crc32"]

    @property
    def sizes(self) -> np.ndarray:
        """(height, width) of each local record's stored image, as an n x 2 array."""
        return np.stack([self._meta["height"], self._meta["width"]], axis=1)

    @property
    def nbytes(self) -> int:
        return int(self._meta["length"].sum(dtype=np.int64))

    def actual_crc32(self) -> np.ndarray:
        """crc32 of the bytes held now, per local record (for verification)."""
        return np.fromiter((crc32(self.record(i)) for i in range(len(self))), np.uint32, len(self))

    # -- shuffle --------------------------------------------------------------------------

    def placement(self, seed: int, round: int) -> np.ndarray:
        """Slot of every global record after ``shuffle(seed, round)`` in this group."""
        if seed < 0 or round < 0:
            raise DimdError(f"seed and round must be non-negative (got {seed}, {round})")
        return stream(PLACEMENT, seed, round, self.group).permutation(self.total)

    def shuffle(self, seed: int, round: int) -> ShuffleStats:
        """Collective within the group: move records so each rank holds a fresh random share.

        The index rows of the records that change rank go first (an
        ``Alltoall`` of counts, an ``Alltoallv`` of rows), so every rank checks
        that it will fill its slots before any byte moves. Then one
        ``Alltoallv`` of their bytes, sent from a private buffer the leaving
        records are packed into (kept for the next shuffle: its pages stay
        faulted in) and received in place into the store's own segment: the
        records that stay are packed to its front and the arriving ones land
        behind them, so no page of a new segment is faulted in and nothing is
        reassembled afterwards. In a group of one rank it is a new local
        order and moves no bytes.
        """
        start_time = time.perf_counter()
        comm = self.group_comm
        size, rank = comm.Get_size(), comm.Get_rank()
        bounds = balanced_bounds(self.total, size)
        slot_of = self.placement(seed, round)
        sent_records = sent_bytes = received_records = received_bytes = 0
        if size == 1:
            for finish in self.on_change:   # no bytes move, but the records' order does
                finish(self.segment)
            order = np.argsort(slot_of[self._meta["index"]])
            starts, meta = self._starts[order], self._meta[order]
        else:
            dest = np.searchsorted(bounds, slot_of[self._meta["index"]], side="right") - 1
            leaving = np.flatnonzero(dest != rank)
            leaving = leaving[np.argsort(dest[leaving], kind="stable")]
            staying = np.flatnonzero(dest == rank)
            staying = staying[np.argsort(self._starts[staying], kind="stable")]   # in byte order
            send_meta, send_counts = self._meta[leaving], np.bincount(dest[leaving], minlength=size)
            # MPI: the index rows of the records that change ranks
            recv_meta, recv_counts = exchange_rows(comm, send_meta, send_counts)
            meta = np.concatenate((self._meta[staying], recv_meta))
            position = slot_of[meta["index"]] - bounds[rank]
            problem = None
            if len(position) != bounds[rank + 1] - bounds[rank] or (
                    len(position) and np.bincount(position, minlength=len(position)).max() != 1):
                problem = (f"shuffle round {round}: rank {comm.Get_rank()} of group {self.group} "
                           f"would receive {len(position)} records that do not fill its "
                           f"{bounds[rank + 1] - bounds[rank]} slots (a record was lost or duplicated)")
            agree_or_raise(comm, problem)                   # MPI: a lost record fails every rank, before a byte moves

            for finish in self.on_change:   # nobody reads the segment while its bytes move
                finish(self.segment)
            segment, self._data = self.segment, np.empty(0, np.uint8)
            leaving_bytes = int(send_meta["length"].sum(dtype=np.int64))
            sendbuf = gather_bytes(segment.array, self._starts[leaving], send_meta["length"],
                                   out=self._send_buffer(leaving_bytes))
            kept_starts, kept = pack_down(segment.array, self._starts[staying], self._meta["length"][staying])
            arriving = recv_meta["length"].astype(np.int64)
            segment.grow(kept + int(arriving.sum()))   # extends the mapping: the pages in use stay mapped
            # MPI: the records' bytes change ranks
            exchange_bytes(comm, sendbuf, send_meta, send_counts, recv_meta, recv_counts,
                           segment.array[kept : kept + int(arriving.sum())])
            starts = np.concatenate((kept_starts, kept + displacements(arriving)))
            meta[position], starts[position] = meta.copy(), starts.copy()
            sent_records, sent_bytes = len(leaving), len(sendbuf)
            received_records, received_bytes = len(recv_meta), int(arriving.sum())
        self._set(self.segment, starts, meta)
        self.round = round
        return ShuffleStats(round=round, seconds=time.perf_counter() - start_time, group_size=size,
                            records_sent=sent_records, bytes_sent=sent_bytes,
                            records_received=received_records, bytes_received=received_bytes,
                            records_held=len(self), bytes_held=self.nbytes)

    def _send_buffer(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` for the leaving records: the last shuffle's, while it is large enough.

        A fresh buffer's pages are faulted in (and zeroed) as the records are
        copied into it, which cost a shuffle about as much as the copy itself
        on the development VM (docs/shuffle.md); reused, its pages are in
        place. A new one gets an eighth of headroom, as the bytes that leave
        vary from round to round, and pages never written cost no memory.
        The load's memory check counts it (a share beside the store).
        """
        if len(self._send) < nbytes:
            self._send = np.empty(0, np.uint8)   # let the old one go before the new one is made
            self._send = np.empty(nbytes + nbytes // 8, np.uint8)
        return self._send


def _other_sets(dataset: PackedDataset, comm: Any) -> str | None:
    """Collective: why the ranks' ``dataset`` is not one pack everywhere (a stale copy on a node's disk), or None.

    A rank would otherwise cut its share out of another set and fail later, far from the cause. The
    pack is known by its record count, its size and the checksum of its records' CRCs.
    """
    import socket
    import zlib

    mine = (len(dataset), dataset.data_bytes, zlib.crc32(np.ascontiguousarray(dataset.records["crc32"]).tobytes()))
    seen = comm.allgather((mine, socket.gethostname()))
    first, first_host = seen[0]
    other = [(rank, host, found) for rank, (found, host) in enumerate(seen) if found != first]
    if not other:
        return None
    rank, host, (records, nbytes, _) = other[0]
    more = f" (and {len(other) - 1} more rank(s))" if len(other) > 1 else ""
    return (f"{dataset.data_path}: rank {rank} on {host}{more} reads a different pack ({records} records, "
            f"{nbytes} bytes) from rank 0 on {first_host} ({first[0]} records, {first[1]} bytes): every rank "
            f"must read the same pack (a copy on each node's own disk must be identical)")


def _read_range(path: Path, begin: int, out: np.ndarray, advance: Callable[[int], None] | None) -> int:
    """Fill ``out`` with the bytes of ``path`` from ``begin``, in a few large reads."""
    view = out.data
    done = reads = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(begin)
        while done < len(out):
            n = f.readinto(view[done : done + READ_CHUNK])
            reads += 1
            if not n:
                raise DimdError(f"{path}: ends at byte {begin + done}, the index expects "
                                f"{begin + len(out)} (truncated data file?)")
            done += n
            if advance is not None:
                advance(n)
    return reads


def _spot_check(dataset: PackedDataset, first: int, rows: np.ndarray, data: np.ndarray, begin: int) -> str | None:
    """Compare the crc32 of the share's first and last record with the index (cheap mismatch check)."""
    for i in {0, len(rows) - 1} if len(rows) else ():
        start = int(rows["offset"][i]) - begin
        actual = crc32(data[start : start + int(rows["length"][i])])
        if actual != int(rows["crc32"][i]):
            return (f"{dataset.data_path}: the bytes of record {first + i} do not "
                    f"match the crc32 in {dataset.index_path.name} (the data and index files are "
                    f"not a pair, or the data is corrupt)")
    return None
