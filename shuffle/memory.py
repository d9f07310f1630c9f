"""A rank's memory: its own and its decoding workers', the shared store counted once.

The store's segment is mapped by the rank and by every decoding worker, so
adding up their resident sets (RSS) would count it once per process. The
proportional set size (PSS, ``/proc/PID/smaps_rollup``) divides each shared
page among the processes that map it; summed over the rank and its workers
it counts the segment once, plus each process's private memory (and its
share of the libraries the node's processes map).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

from dimd.host import resident_memory
from dimd.units import format_bytes

#: What one decoding worker costs its rank (interpreter, numpy, Pillow, decode buffers), as the
#: ``--memory-limit`` check counts it before the workers exist: measured about 22 MiB private and
#: 32-50 MiB PSS per worker after an epoch at 224 px (docs/shuffle.md, "Memory per rank").
WORKER_PRIVATE_BYTES = 48 << 20
#: Bytes per value of the step's input beside the batch slots: the uint8 batch copied out and its float32 form.
INPUT_BYTES_PER_VALUE = 1 + 4


def batch_memory(batch_size: int, image_size: int, slots: int, decode_workers: int) -> int:
    """Bytes a loader's batches need at least, beside the store, as the load's memory check counts them.

    The ring of ``slots`` shared batch slots (uint8 N x 3 x S x S), the batch
    the step takes from it with its float32 copy, and in each worker the crop
    it resizes and writes (two images of S x S). A lower bound (the model's
    activations come on top), enough to refuse an image size that could never
    run before a worker asks the kernel for it.
    """
    image = 3 * image_size * image_size
    return image * (batch_size * (slots + INPUT_BYTES_PER_VALUE) + 2 * decode_workers)

_FIELDS = {"Rss:": "rss", "Pss:": "pss", "Private_Clean:": "private", "Private_Dirty:": "private"}


@dataclass(frozen=True)
class ProcessMemory:
    """One process, in bytes: resident, proportional, and held by it alone (0 for a process that is gone)."""

    rss: int = 0
    pss: int = 0
    private: int = 0


def process_memory(pid: int | str = "self") -> ProcessMemory:
    """``pid``'s memory from ``/proc/PID/smaps_rollup`` (Linux 4.14+; else its VmRSS for all three)."""
    figures = {"rss": 0, "pss": 0, "private": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = _FIELDS.get(line.split(" ", 1)[0])
                if key is not None:
                    figures[key] += int(line.split()[1]) * 1024
    except FileNotFoundError:
        rss = resident_memory(pid)
        return ProcessMemory(rss, rss, rss)
    except OSError:   # the process is gone, or not ours to read
        pass
    return ProcessMemory(**figures)


@dataclass(frozen=True)
class RankMemory:
    """A rank with its decoding workers, in bytes.

    ``total`` is what the rank costs the node: the PSS of the rank and of each
    worker, summed (the store's shared segment once). ``rank_rss`` is what
    ``ps`` shows for the rank; ``workers_private`` what the workers hold that
    no other process shares (interpreter, numpy, Pillow, decode buffers).
    """

    total: int
    rank_rss: int
    rank_pss: int
    workers: int
    workers_pss: int
    workers_private: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return (f"{format_bytes(self.total)} (the rank {format_bytes(self.rank_pss)}, "
                f"{self.workers} decoding worker{'s' * (self.workers != 1)} {format_bytes(self.workers_pss)})")


def rank_memory(worker_pids: Iterable[int] = ()) -> RankMemory:
    """This process and its decoding workers ``worker_pids`` (see :class:`RankMemory`)."""
    rank = process_memory()
    workers = [process_memory(pid) for pid in worker_pids]
    workers_pss = sum(w.pss for w in workers)
    return RankMemory(total=rank.pss + workers_pss, rank_rss=rank.rss, rank_pss=rank.pss, workers=len(workers),
                      workers_pss=workers_pss, workers_private=sum(w.private for w in workers))


def gather_rank_memory(comm: Any, worker_pids: Iterable[int] = ()) -> list[dict[str, int]]:
    """Collective: every rank's :class:`RankMemory`, as dicts in rank order."""
    return comm.allgather(rank_memory(worker_pids).as_dict())


def describe_ranks(figures: list[dict[str, int]]) -> str:
    """One line for a run's log: each rank's total, and what its workers add."""
    ranks = "; ".join(f"rank {k} {RankMemory(**m).describe()}" for k, m in enumerate(figures))
    return f"memory (proportional set size, the shared store counted once): {ranks}"
