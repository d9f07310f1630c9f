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

from dimd.checks import at_least, finite, positive
from dimd.host import resident_memory
from dimd.stall import STALL_TIMEOUT_S, watch_job
from dimd.mpi import agreed
from dimd.shuffle.store import DistributedStore, packed_record_count
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
    stall_timeout: float = STALL_TIMEOUT_S   # seconds a rank waits for the others after the load; 0: forever

    def __post_init__(self) -> None:
        at_least(self, "groups", 1)
        at_least(self, "rounds", 0)
        at_least(self, "seed", 0)
        positive(self, "memory_limit", optional=True)
        at_least(self, "stall_timeout", 0)
        finite(self, "stall_timeout")


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
    """Collective: load ``config.dataset`` over ``comm``, then shuffle it ``config.rounds`` times.

    After the load (whose reads may lag each other by any time), every wait for
    the other ranks is watched: one that outlasts ``config.stall_timeout`` ends
    the job with a line naming it (:mod:`dimd.stall`).
    """
    comm.Barrier()
    check_every_rank_holds_records(config, comm)
    store = DistributedStore.load(config.dataset, comm, config.groups, config.memory_limit,
                                  advance=advance_load)
    if config.save_order is not None:
        os.makedirs(config.save_order, exist_ok=True)
    with watch_job(comm, config.stall_timeout) as watchdog:   # MPI: a lost peer ends the job, not hangs it
        with watchdog.waiting("the figures of the load"):
            run = _load_figures(config, store, comm)
        if on_load is not None:
            on_load(run)
        for r in range(config.rounds):
            with watchdog.waiting(f"the shuffle of round {r}"):
                figures = _shuffle_round(config, store, comm, r)
            run.rounds.append(figures)
            if on_round is not None:
                on_round(figures)
    return run


def check_every_rank_holds_records(config: ShuffleConfig, comm: Any) -> None:
    """Collective: refuse, before the load, a set with fewer records than the ranks of a group (which share
    one copy of it): a rank with none would shuffle nothing, and its figures would say so only afterwards."""
    size = comm.Get_size()
    if config.groups < 1 or size % config.groups:
        return   # the load names the groups that do not divide the ranks
    ranks = size // config.groups
    records = packed_record_count(comm, config.dataset)   # MPI: rank 0 read the index for every rank
    if records < ranks:
        raise agreed(comm, f"{config.dataset}.dimd: {records} record{' is' if records == 1 else 's are'} fewer "
                           f"than the {ranks} ranks that share a copy (each rank needs one); run fewer ranks"
                           + (" or more `groups`" if config.groups < size else ""))


def _load_figures(config: ShuffleConfig, store: DistributedStore, comm: Any) -> ShuffleRun:
    """Collective: the load's figures over the job, after the optional check that no record was lost."""
    from mpi4py import MPI

    if config.verify:
        check_group(store, "the load")
    return ShuffleRun(config=config, world_size=comm.Get_size(), groups=config.groups,
                      group_size=store.group_comm.Get_size(), records=store.total,
                      data_bytes=int(comm.allreduce(store.nbytes) // config.groups),
                      load_seconds=comm.allreduce(store.load_stats.seconds, op=MPI.MAX),
                      load_reads=comm.allreduce(store.load_stats.reads),
                      load_resident_bytes=comm.allgather(resident_memory()), load_verified=config.verify)


def _shuffle_round(config: ShuffleConfig, store: DistributedStore, comm: Any, r: int) -> RoundFigures:
    """Collective: shuffle round ``r`` (timed from a barrier), save and check it as asked, its figures over the job."""
    from mpi4py import MPI

    comm.Barrier()
    stats = store.shuffle(config.seed, r)
    if config.save_order is not None:
        np.save(Path(config.save_order) / f"round{r}_rank{comm.Get_rank()}.npy", store.global_index)
    if config.verify:
        check_group(store, f"round {r}")
    seconds = comm.allreduce(stats.seconds, op=MPI.MAX)
    moved = comm.allreduce(stats.bytes_sent)
    return RoundFigures(round=r, seconds=seconds, records_moved=comm.allreduce(stats.records_sent),
                        bytes_moved=moved, gb_per_s=moved / seconds / 1e9 if seconds > 0 else 0.0,
                        resident_bytes=comm.allgather(resident_memory()),
                        records_held=comm.allgather(stats.records_held), verified=config.verify)
