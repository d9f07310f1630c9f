"""What ``mpirun dimd shuffle`` runs: a partitioned load, then timed shuffle rounds, optionally verified.

The library part of the command: it takes a frozen config and the world
communicator, reports each round through a callback, and returns the figures
(reduced over ranks, identical on every rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dimd.checks import at_least, positive
from dimd.host import resident_memory
from dimd.shuffle.store import DistributedStore
from dimd.shuffle.verify import check_group


@dataclass(frozen=True)
class ShuffleConfig:
    dataset: Path
    groups: int = 1
    rounds: int = 5
    seed: int = 0
    verify: bool = False
    save_order: Path | None = None
    memory_limit: int | None = None   # bytes per rank

    def __post_init__(self) -> None:
        at_least(self, "groups", 1)
        at_least(self, "rounds", 0)
        at_least(self, "seed", 0)
        positive(self, "memory_limit", optional=True)


@dataclass(frozen=True)
class RoundFigures:
    """One shuffle round over the job: times are the max over ranks, bytes the sum."""

    round: int
    seconds: float
    records_moved: int
    bytes_moved: int
    gb_per_s: float
    resident_bytes: list[int]
    records_held: list[int]
    verified: bool


@dataclass
class ShuffleRun:
    config: ShuffleConfig
    world_size: int
    groups: int
    group_size: int
    records: int
    data_bytes: int
    load_seconds: float
    load_reads: int
    load_resident_bytes: list[int]
    load_verified: bool
    rounds: list[RoundFigures] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """The ``--json`` figures (the CLI wraps them in the standard envelope)."""
        return {"world_size": self.world_size, "groups": self.groups, "group_size": self.group_size,
                "records": self.records, "data_bytes": self.data_bytes,
                "load": {"seconds": self.load_seconds, "reads": self.load_reads,
                         "resident_bytes": self.load_resident_bytes, "verified": self.load_verified},
                "rounds": self.rounds, "summary": self.summary()}

    def summary(self) -> dict[str, Any]:
        seconds = [r.seconds for r in self.rounds]
        moved = [r.bytes_moved for r in self.rounds]
        rates = [r.gb_per_s for r in self.rounds]
        return {
            "rounds": len(self.rounds),
            "seconds_median": float(np.median(seconds)) if seconds else None,
            "seconds_min": min(seconds, default=None),
            "seconds_max": max(seconds, default=None),
            "bytes_moved_median": float(np.median(moved)) if moved else None,
            "gb_per_s_median": float(np.median(rates)) if rates else None,
            "load_gb_per_s": self.data_bytes * self.groups / self.load_seconds / 1e9
            if self.load_seconds > 0 else None,
            "verified": self.config.verify,
        }


def run_shuffle(config: ShuffleConfig, comm: Any, *, advance_load: Callable[[int], None] | None = None,
                on_load: Callable[[ShuffleRun], None] | None = None,
                on_round: Callable[[RoundFigures], None] | None = None) -> ShuffleRun:
    """Collective: load ``config.dataset`` over ``comm``, then shuffle it ``config.rounds`` times."""
    from mpi4py import MPI

    comm.Barrier()
    store = DistributedStore.load(config.dataset, comm, config.groups, config.memory_limit,
                                  advance=advance_load)
    if config.save_order is not None:
        os.makedirs(config.save_order, exist_ok=True)
    verified = False
    if config.verify:
        check_group(store, "the load")
        verified = True
    run = ShuffleRun(config=config, world_size=comm.Get_size(), groups=config.groups,
                     group_size=store.group_comm.Get_size(), records=store.total,
                     data_bytes=int(comm.allreduce(store.nbytes) // config.groups),
                     load_seconds=comm.allreduce(store.load_stats.seconds, op=MPI.MAX),
                     load_reads=comm.allreduce(store.load_stats.reads),
                     load_resident_bytes=comm.allgather(resident_memory()), load_verified=verified)
    if on_load is not None:
        on_load(run)
    for r in range(config.rounds):
        comm.Barrier()
        stats = store.shuffle(config.seed, r)
        if config.save_order is not None:
            np.save(Path(config.save_order) / f"round{r}_rank{comm.Get_rank()}.npy", store.global_index)
        if config.verify:
            check_group(store, f"round {r}")
        seconds = comm.allreduce(stats.seconds, op=MPI.MAX)
        moved = comm.allreduce(stats.bytes_sent)
        figures = RoundFigures(round=r, seconds=seconds, records_moved=comm.allreduce(stats.records_sent),
                               bytes_moved=moved, gb_per_s=moved / seconds / 1e9 if seconds > 0 else 0.0,
                               resident_bytes=comm.allgather(resident_memory()),
                               records_held=comm.allgather(stats.records_held), verified=config.verify)
        run.rounds.append(figures)
        if on_round is not None:
            on_round(figures)
    return run
