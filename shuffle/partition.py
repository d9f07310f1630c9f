"""Who holds what: groups of consecutive ranks, balanced contiguous shares, the memory check.

A group of ranks together holds every record once; with G groups every
group holds the whole set (DIMD paper, section 4.1, "Partitioned Load").
Shares are balanced by record count, so every rank of a group holds
``total // size`` or one more records, both after the load and after each
shuffle.
"""

from __future__ import annotations

from typing import Any

from dimd.errors import DimdError
from dimd.units import format_bytes


def split_groups(comm: Any, groups: int) -> Any:
    """The communicator of this rank's group: ``groups`` groups of consecutive ranks."""
    size = comm.Get_size()
    if groups < 1 or size % groups:
        raise DimdError(f"`groups` {groups} does not divide the {size} ranks of the job "
                        f"(choose a divisor of {size})")
    per_group = size // groups
    rank = comm.Get_rank()
    return comm.Split(color=rank // per_group, key=rank)


def memory_problem(need: int, *, budget: int, memory_limit: int | None, rank: int,
                   records: int, group_size: int, path: str, workers: int = 0) -> str | None:
    """The error text when ``need`` bytes do not fit this rank's budget, else None."""
    limits = [(budget, "available memory per rank on this node")]
    if memory_limit is not None:
        limits.append((memory_limit, "`memory_limit`"))
    for limit, what in limits:
        if need > limit:
            decoders = f" and its {workers} decoding worker{'s' * (workers != 1)}" if workers else ""
            return (f"{path}: rank {rank}'s share ({records} records){decoders} needs {format_bytes(need)} "
                    f"but the {what} is {format_bytes(limit)}; use more ranks per group "
                    f"(fewer `groups`; a group now has {group_size} ranks) or more ranks")
    return None
