"""Start MPI on purpose: thread level, MPICH's progress throttle, and what was chosen.

mpi4py's default (THREAD_MULTIPLE, initialised at import) turns off MPICH's
shared-memory collectives, and oversubscribed MPICH ranks spin; both cost an
order of magnitude on one node (see DESIGN.md, "MPI on one machine"). Every
dimd command that uses MPI starts it through :func:`init_mpi`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Literal, MutableMapping

from dimd.errors import DimdError
from dimd.host import available_cores

ThreadLevel = Literal["single", "funneled", "serialized", "multiple"]

_THROTTLE = {
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
}


@dataclass(frozen=True)
class MpiSetup:
    """What :func:`init_mpi` chose; goes into every benchmark's JSON."""

    thread_level_requested: str
    thread_level_provided: str
    progress_throttle: bool
    local_ranks: int | None
    cores: int
    library_version: str
    world_size: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def node_local_ranks(comm: Any) -> int:
    """How many ranks of ``comm`` share this rank's node (and so its cores and memory)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return local.Get_size()
    finally:
        local.Free()


def agree_or_raise(comm: Any, problem: str | None) -> None:
    """Collective: if any rank has a problem, every rank raises it (the first one's text).

    A library error raised on one rank alone would leave the others waiting in
    the next collective; this way the whole job sees it.
    """
    problems = comm.allgather(problem)
    for found in problems:
        if found is not None:
            raise DimdError(found)


def local_rank_count(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Ranks on this node, as the launcher exports it (MPICH/Hydra, Open MPI, SLURM)."""
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def prepare_environment(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set MPICH's progress throttle when this node's ranks outnumber its cores.

    Must run before MPI initialises. A value the user set is left alone.
    Returns whether the throttle is on.
    """
    local = local_rank_count(environ)
    if local is not None and local > available_cores():
        for key, value in _THROTTLE.items():
            environ.setdefault(key, value)
    return all(environ.get(key) == value for key, value in _THROTTLE.items())


_setup: MpiSetup | None = None


def init_mpi(thread_level: ThreadLevel = "single") -> MpiSetup:
    """Initialise MPI once, at ``thread_level``; later calls return the first setup.

    ``single`` suits code that calls MPI from one thread and runs no threads
    of its own that touch MPI; ``funneled`` allows worker threads (decoders)
    while only the main thread calls MPI.
    """
    global _setup
    if _setup is not None:
        return _setup
    throttle = prepare_environment()
    import mpi4py

    mpi4py.rc.thread_level = thread_level
    mpi4py.rc.threads = thread_level != "single"
    from mpi4py import MPI

    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    _setup = MpiSetup(
        thread_level_requested=thread_level,
        thread_level_provided=names.get(MPI.Query_thread(), str(MPI.Query_thread())),
        progress_throttle=throttle,
        local_ranks=local_rank_count(),
        cores=available_cores(),
        library_version=MPI.Get_library_version().strip().splitlines()[0].strip(),
        world_size=MPI.COMM_WORLD.Get_size(),
    )
    return _setup
