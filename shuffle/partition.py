"""Who holds what: groups of consecutive ranks, balanced contiguous shares, the memory check.

A group of ranks together holds every record once; with G groups every
group holds the whole set (DIMD paper, section 4.1, "Partitioned Load").
Shares are balanced by record count, so every rank of a group holds
``total // size`` or one more records, both after the load and after each
shuffle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dimd.units import format_bytes


def split_groups(comm: Any, groups: int) -> Any:
    """The communicator of this rank's group: ``groups`` groups of consecutive ranks."""
    from dimd.mpi import agreed

    size = comm.Get_size()
    if groups < 1 or size % groups:   # every rank finds it alike
        raise agreed(comm, f"`groups` {groups} does not divide the {size} ranks of the job "
                           f"(choose a divisor of {size})")
    per_group = size // groups
    rank = comm.Get_rank()
    return comm.Split(color=rank // per_group, key=rank)


@dataclass(frozen=True)
class MemoryNeed:
    """What a rank needs, by what the user can change: the share of the records (and what a shuffle
    sends of it), the decoding workers' own memory, the loaders' batches (what
    :class:`dimd.shuffle.memory.RankMemory` measures, a run later)."""

    share_bytes: int
    worker_bytes: int = 0
    batch_bytes: int = 0

    @property
    def total(self) -> int:
        return self.share_bytes + self.worker_bytes + self.batch_bytes


def memory_problem(need: MemoryNeed, *, budget: int, memory_limit: int | None, rank: int, records: int,
                   group_size: int, groups: int, path: str, decode_workers: int = 0) -> str | None:
    """The error text when ``need`` does not fit this rank's budget, else None; its advice is about the
    largest part."""
    limits = [(budget, "available memory per rank on this node")]
    if memory_limit is not None:
        limits.append((memory_limit, "`memory_limit`"))
    for limit, what in limits:
        if need.total > limit:
            decoders = (f", its {decode_workers} decoding worker{'s' * (decode_workers != 1)}"
                        if decode_workers else "")
            batches = " and its batches" if need.batch_bytes else ""
            how = f" (fewer `groups`: a group now has {group_size} ranks, or more ranks)" if groups > 1 else ""
            remedies = [(need.share_bytes, f"spread the set over more ranks{how}"),
                        (need.batch_bytes, "use a smaller batch or image size")]
            if decode_workers > 1:
                remedies.append((need.worker_bytes, "use fewer decoding workers"))
            advice = max(remedies, key=lambda remedy: remedy[0])[1]   # the largest part that can shrink
            verb = "need" if decoders or batches else "needs"
            return (f"{path}: rank {rank}'s share ({records} records){decoders}{batches} {verb} "
                    f"{format_bytes(need.total)} but the {what} is {format_bytes(limit)}; {advice}")
    return None
