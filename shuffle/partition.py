"""Who holds what: groups of consecutive ranks, balanced contiguous shares, the memory check.

A group of ranks together holds every record once; with G groups every
group holds the whole set (DIMD paper, section 4.1, "Partitioned Load").
Shares are balanced by record count, so every rank of a group holds
``total // size`` or one more records, both after the load and after each
shuffle.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dimd.errors import DimdError
from dimd.units import format_bytes


def share_bounds(total: int, parts: int) -> np.ndarray:
    """``parts + 1`` boundaries splitting ``total`` items into balanced contiguous shares.

    Share ``k`` is ``[bounds[k], bounds[k+1])``; the first ``total % parts``
    shares hold one item more (as ``np.array_split``).
    """
    sizes = np.full(parts, total // parts, np.int64)
    sizes[: total % parts] += 1
    return np.concatenate(([0], np.cumsum(sizes)))


def split_groups(comm: Any, groups: int) -> Any:
    """The communicator of this rank's group: ``groups`` groups of consecutive ranks."""
    size = comm.Get_size()
    if groups < 1 or size % groups:
        raise DimdError(f"--groups {groups} does not divide the {size} ranks of the job "
                        f"(choose a divisor of {size})")
    per_group = size // groups
    rank = comm.Get_rank()
    return comm.Split(color=rank // per_group, key=rank)


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * int(os.sysconf("SC_PAGE_SIZE")) if pages else 1 << 62


def resident_memory() -> int:
    """This process's resident set size in bytes (VmRSS), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_problem(need: int, *, budget: int, memory_limit: int | None, rank: int,
                   records: int, group_size: int, path: str) -> str | None:
    """The error text when ``need`` bytes do not fit this rank's budget, else None."""
    limits = [(budget, "available memory per rank on this node")]
    if memory_limit is not None:
        limits.append((memory_limit, "--memory-limit"))
    for limit, what in limits:
        if need > limit:
            return (f"{path}: rank {rank}'s share ({records} records) needs {format_bytes(need)} "
                    f"but the {what} is {format_bytes(limit)}; use more ranks per group "
                    f"(fewer --groups; a group now has {group_size} ranks) or more ranks")
    return None


def agree_or_raise(comm: Any, problem: str | None) -> None:
    """Collective: if any rank has a problem, every rank raises it (the first one's text).

    A library error raised on one rank alone would leave the others waiting in
    the next collective; this way the whole job sees it.
    """
    problems = comm.allgather(problem)
    for found in problems:
        if found is not None:
            raise DimdError(found)
