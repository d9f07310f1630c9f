"""Start MPI on purpose: thread level, idle ranks on a crowded node, and what was chosen.

mpi4py's default (THREAD_MULTIPLE, initialised at import) turns off MPICH's
shared-memory collectives, and oversubscribed ranks that spin while they wait
cost an order of magnitude on one node (docs/mpi.md#mpi-on-one-machine). Every
dimd command that uses MPI starts it through :func:`init_mpi`. When a node's
ranks outnumber its cores it sets each MPI's own remedy before MPI starts
(MPICH's progress throttle, Open MPI's ``mpi_yield_when_idle``) and records
only the one the running library honours. It also refuses the singleton trap:
a launcher that started N processes which each see an MPI world of one (plain
``srun`` with the mpich wheel, see
docs/batch-jobs.md#mpi-under-slurm-one-job-not-n-singletons) would otherwise run N
silent, separate jobs.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal, Mapping, MutableMapping, NoReturn

from dimd.errors import DimdError
from dimd.host import affinity, available_cores, launcher_cores
from dimd.private_apis import watch_abort_requests

ThreadLevel = Literal["single", "funneled", "serialized", "multiple"]

#: MPICH: waiting ranks back off instead of polling (ignored by other MPIs).
_THROTTLE = {
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
}
#: Open MPI: a rank with nothing to do yields its core (ignored by other MPIs).
_YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}
#: Between an error line and MPI_Abort: the abort tears the job down at once, and the launcher
#: (Hydra, srun, mpirun) may not yet have forwarded the line, so the user would see no reason.
FORWARD_GRACE_S = 0.5


@dataclass(frozen=True)
class MpiSetup:
    """What :func:`init_mpi` chose and found; goes into every command's JSON.

    ``progress_throttle`` and ``yield_when_idle`` are true only when the running
    MPI is the one that reads them (MPICH, Open MPI) and they were in force.
    """

    thread_level_requested: str
    thread_level_provided: str
    progress_throttle: bool
    yield_when_idle: bool
    local_ranks: int
    cores: int
    rank_cores: int
    oversubscribed: bool
    library_version: str
    world_size: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NodeCores:
    """How a node's ranks share its cores: gathered from every node-local rank's CPU affinity.

    A launcher may bind each rank to a few cores (Open MPI binds to one core at
    2 ranks or fewer; ``srun --cpus-per-task``; ``mpiexec -bind-to core``), so a
    rank's own affinity is not the node's cores: the node's are the union of its
    ranks' affinities, and a rank's threads are its own cores shared by the
    node-local ranks bound to the same set.
    """

    node: int           # the union of the node-local ranks' affinities
    own: int            # this rank's affinity
    local_ranks: int    # ranks on this node
    sharing: int        # node-local ranks (this one included) bound to exactly this rank's set

    @property
    def threads(self) -> int:
        """Compute threads for this rank: its cores over the ranks that share them."""
        return max(1, self.own // self.sharing)

    @property
    def oversubscribed(self) -> bool:
        return self.local_ranks > self.node

    def tight_binding(self) -> str | None:
        """A warning when the launcher's binding leaves this rank less than its fair share."""
        fair = self.node // self.local_ranks
        if self.threads >= fair:
            return None
        return (f"the launcher binds each rank to {self.own} core(s) of the node's {self.node} for "
                f"{self.local_ranks} rank(s) on the node, so it gets {self.threads} thread(s) where "
                f"{fair} are free: start it without binding (Open MPI: mpirun --bind-to none; MPICH: "
                f"leave out -bind-to) or set --threads")

    def too_many_threads(self, threads: int) -> str | None:
        """A warning when ``threads`` asked for per rank outnumber this rank's cores: the threads then
        take turns on them, and each step waits for the slowest."""
        if threads <= self.threads:
            return None
        if self.sharing == 1:
            return (f"--threads {threads} outnumbers the {self.own} core(s) this rank has, which slows the steps; "
                    f"leave it out for {self.threads}")
        return (f"--threads {threads} on each of {self.sharing} ranks sharing {self.own} core(s) outnumbers "
                f"them, which slows the steps; leave it out for {self.threads} per rank")


def node_cores(comm: Any) -> NodeCores:
    """Collective over ``comm``: the CPU affinities of this node's ranks, gathered and compared."""
    from mpi4py import MPI

    mine = affinity()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        masks = [frozenset(mask) for mask in local.allgather(sorted(mine))]
    finally:
        local.Free()
    union = frozenset().union(*masks)
    return NodeCores(node=len(union) or available_cores(), own=len(mine) or available_cores(),
                     local_ranks=len(masks), sharing=sum(mask == mine for mask in masks))


def node_local_ranks(comm: Any) -> int:
    """How many ranks of ``comm`` share this rank's node (and so its cores and memory)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return local.Get_size()
    finally:
        local.Free()


class AgreedError(DimdError):
    """A problem every rank of the job raised at the same point, with the same text.

    Every rank knows it, so the job can end in order (``MPI_Finalize`` and an
    exit status) rather than by ``MPI_Abort`` (dimd.commands.mpi_job).
    """


def agreed(comm: Any, problem: str) -> DimdError:
    """The error for a problem every rank of ``comm`` raises at once.

    An :class:`AgreedError` where ``comm`` spans the whole job; over a part of
    it (a shuffle group, a convergence run's ranks) the other ranks know
    nothing, so a plain :class:`DimdError`, which aborts the job.
    """
    from mpi4py import MPI

    return AgreedError(problem) if comm.Get_size() == MPI.COMM_WORLD.Get_size() else DimdError(problem)


def agree_or_raise(comm: Any, problem: str | None) -> None:
    """Collective: if any rank has a problem, every rank raises it (the first one's text).

    A library error raised on one rank alone would leave the others waiting in
    the next collective; this way the whole job sees it.
    """
    problems = comm.allgather(problem)
    for found in problems:
        if found is not None:
            raise agreed(comm, found)


def local_rank_count(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Ranks on this node, as the launcher exports it (MPICH/Hydra, Open MPI, SLURM)."""
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def prepare_environment(environ: MutableMapping[str, str] = os.environ) -> dict[str, bool]:
    """Set each MPI's remedy for idle ranks when this node's ranks outnumber its cores.

    Must run before MPI initialises, so the node's cores are the launcher's
    (:func:`dimd.host.launcher_cores`: a rank bound to one core does not make a
    node of one core). A value the user set is left alone. Returns which
    remedies are in force: ``progress_throttle`` (MPICH), ``yield_when_idle`` (Open MPI).
    """
    local = local_rank_count(environ)
    if local is not None and local > launcher_cores():
        for key, value in {**_THROTTLE, **_YIELD}.items():
            environ.setdefault(key, value)
    return {"progress_throttle": all(environ.get(key) == value for key, value in _THROTTLE.items()),
            "yield_when_idle": all(environ.get(key) == value for key, value in _YIELD.items())}


def library_version() -> str:
    """The first line of MPI's library version, without Open MPI's trailing NUL (grep calls a log with one binary)."""
    from mpi4py import MPI

    text = MPI.Get_library_version().replace("\0", "").strip()
    return text.splitlines()[0].strip() if text else "unknown MPI"


class LaunchMismatch(DimdError):
    """A launcher started several processes, but MPI gave each a world of its own.

    ``first_task`` is true on the launcher's first process (task or rank 0),
    the one that should say so, so a job of N tasks prints one line, not N.
    """

    def __init__(self, message: str, first_task: bool) -> None:
        super().__init__(message)
        self.first_task = first_task


#: (size variable, rank variable, launcher): launchers that say how many processes they
#: started for this step. Job-wide counts (SLURM_NTASKS, LSB_DJOB_NUMPROC) are not here:
#: `mpiexec -n 1` inside a bigger allocation is a deliberate one-rank run.
LAUNCHER_SIZES = (
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "srun"),
    ("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK", "jsrun"),          # LSF on IBM CSM systems
    ("FLUX_JOB_SIZE", "FLUX_TASK_RANK", "flux run"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpirun"),  # also prterun, jsrun
    ("PMI_SIZE", "PMI_RANK", "the launcher's PMI"),                 # Hydra's mpiexec, srun --mpi=pmi2
)
#: Variables a launcher that wired up MPI sets to the world size itself: their "1" is deliberate.
_WIRED_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _count(environ: Mapping[str, str], key: str) -> int | None:
    value = environ.get(key, "").strip()
    return int(value) if value.isdigit() else None


def launch_mismatch(world_size: int, library: str,
                    environ: Mapping[str, str] = os.environ) -> LaunchMismatch | None:
    """The singleton trap, or None: a launcher started N > 1 processes, MPI's world is 1.

    ``mpiexec -n 2`` inside a SLURM allocation shows SLURM_STEP_NUM_TASKS=1 (one
    proxy per node) with PMI_SIZE=2 and a world of 2: fine. ``srun -n 1`` is a
    deliberate one-rank run: fine. A PMIx launcher says no size, but a PMIx rank
    above 0 in a world of one is the same trap.
    """
    if world_size != 1 or any(_count(environ, key) == 1 for key in _WIRED_SIZES):
        return None
    mpi = " ".join(library.split(",")[0].replace("Version:", "").split()) or "this MPI"
    for size_key, rank_key, launcher in LAUNCHER_SIZES:
        tasks = _count(environ, size_key)
        if tasks is None or tasks <= 1:
            continue
        srun_mpi = environ.get("SLURM_MPI_TYPE", "none")
        if size_key == "SLURM_STEP_NUM_TASKS" and srun_mpi != "none":
            advice = (f"it does not use the PMI that srun --mpi={srun_mpi} gives (the mpich wheel "
                      f"needs --mpi=pmi2; a site MPI needs mpi4py built against it and the --mpi "
                      f"type the site documents)")
        elif size_key == "SLURM_STEP_NUM_TASKS":
            advice = (f"launch with `srun --mpi=pmi2` (or export SLURM_MPI_TYPE=pmi2) or with "
                      f"`mpiexec -n {tasks}` inside the allocation; with a site MPI, build mpi4py "
                      f"against it and use the --mpi type the site documents")
        else:
            advice = (f"mpi4py's MPI is not the one {launcher} serves: start dimd with that MPI's "
                      f"own mpiexec, or build mpi4py against the MPI that {launcher} belongs to")
        return LaunchMismatch(
            f"{launcher} started {tasks} processes ({size_key}={tasks}) but {mpi} gives each a "
            f"world of 1 rank: they would run as {tasks} separate jobs; {advice}",
            first_task=_count(environ, rank_key) in (0, None))
    pmix_rank = _count(environ, "PMIX_RANK")
    if pmix_rank:
        return LaunchMismatch(
            f"a PMIx launcher gave this process rank {pmix_rank} (PMIX_RANK={pmix_rank}) but {mpi} "
            f"gives it a world of 1 rank: mpi4py's MPI is not the one the launcher serves; build "
            f"mpi4py against the site's MPI, or start dimd with its own mpiexec",
            first_task=pmix_rank == 1)  # rank 0 cannot tell: it sees no rank of its own
    return None


def require_on_every_rank(comm: Any, path: str, what: str) -> None:
    """Collective: an error on every rank (:func:`agreed`) unless every rank sees ``path`` (a checkpoint, a data set).

    A folder on one node's own disk is found by that node's ranks only; the
    others would each fail with "not found" and no hint why.
    """
    import socket

    seen = comm.allgather((os.path.exists(path), socket.gethostname()))
    missing = [(rank, host) for rank, (found, host) in enumerate(seen) if not found]
    if not missing:
        return
    if len(missing) == len(seen):
        raise agreed(comm, f"{path}: {what} not found")
    where = ", ".join(f"rank {rank} on {host}" for rank, host in missing[:4]) + (", ..." if len(missing) > 4 else "")
    raise agreed(comm, f"{path}: {what} not found by {where} (rank 0 on {seen[0][1]} sees it): its folder must "
                       f"be visible on every node, on a file system they share")


def launched_ranks(environ: Mapping[str, str] = os.environ) -> int | None:
    """How many processes the launcher started, as it exported it (before MPI starts); None outside one."""
    for size_key, _, _ in LAUNCHER_SIZES:
        size = _count(environ, size_key)
        if size is not None:
            return size
    return None


def launcher_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's rank as its launcher exported it (before MPI starts), None outside a launcher.

    For what every rank would print alike before MPI starts (a usage error):
    the first rank says it (:func:`leaves_quietly`).
    """
    for key in (*(rank_key for _, rank_key, _ in LAUNCHER_SIZES), "PMIX_RANK"):
        rank = _count(environ, key)
        if rank is not None:
            return rank
    return None


def leaves_quietly(first_task: bool) -> bool:
    """Whether this process should exit 0 at once, silently: all but the launcher's first task.

    For a failure every process of a launch meets alike before MPI can order
    them (a usage error, the singleton trap): the first task prints the line
    and its non-zero exit gives the job its status. The others must not exit
    non-zero before it has: a launcher that ends the job at the first non-zero
    exit (Open MPI's ``mpirun``, ``srun --kill-on-bad-exit``) would cut it off
    with its line unsaid. The caller exits::

        if leaves_quietly(exc.first_task):
            sys.exit(0)
    """
    return not first_task


#: MPICH keeps one shared-memory file per node under this name for the job's life (mpich_shm_<hex>_0).
_MPICH_NODE_FILES = "/dev/shm/mpich_shm_"


def unlink_node_files() -> None:
    """Unlink MPICH's per-node shared-memory file; call once every rank of the node has mapped it.

    MPICH links the file while the job runs and unlinks it in
    ``MPI_Finalize``, so a job whose rank was killed or aborted left 2 MiB in
    ``/dev/shm`` until the machine restarted. Nameless, it stays while any rank
    maps it and goes with the last of them, however they end. MPICH never
    opens it by name again after start-up (checked with MPICH 5.0.2:
    point-to-point, collectives, shared windows and ``MPI_Finalize`` run
    as before).
    """
    for path in mapped_files(_MPICH_NODE_FILES):
        with contextlib.suppress(OSError):   # another rank of the node was first
            os.unlink(path)


def abort(comm: Any, code: int) -> NoReturn:
    """``MPI_Abort(comm, code)``, for one rank's error or a stall: every rank of the job ends."""
    comm.Abort(code)
    raise SystemExit(code)   # not reached: MPI_Abort does not return


def mapped_files(prefix: str, maps: str = "/proc/self/maps") -> list[str]:
    """The files whose names start with ``prefix`` that this process maps and that still have their name."""
    try:
        with open(maps) as lines:
            fields = [line.rstrip("\n").split(maxsplit=5) for line in lines]
    except OSError:   # no /proc (not Linux)
        return []
    paths = {parts[5] for parts in fields if len(parts) == 6}   # the mapped file's path, if any
    return sorted(path for path in paths if path.startswith(prefix) and not path.endswith(" (deleted)"))


_setup: MpiSetup | None = None


def init_mpi(thread_level: ThreadLevel = "single") -> MpiSetup:
    """Initialise MPI once, at ``thread_level``; later calls return the first setup.

    ``single`` suits code that calls MPI from one thread and runs no threads
    of its own that touch MPI; ``funneled`` allows worker threads (decoders)
    while only the main thread calls MPI. Raises :class:`LaunchMismatch` when a
    launcher started several processes that each got a world of one rank.
    """
    global _setup
    if _setup is not None:
        return _setup
    tuning = prepare_environment()
    import mpi4py

    mpi4py.rc.thread_level = thread_level
    mpi4py.rc.threads = thread_level != "single"
    with warnings.catch_warnings():   # mpi4py's three lines on another MPI's launcher: launch_mismatch says one
        warnings.filterwarnings("ignore", "suspicious MPI execution environment", RuntimeWarning)
        from mpi4py import MPI

    watch_abort_requests()   # what python -m mpi4py will ask for at exit (dimd.init's exit watch reads it)
    library = library_version()
    mismatch = launch_mismatch(MPI.COMM_WORLD.Get_size(), library)
    if mismatch is not None:
        raise mismatch
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    cores = node_cores(MPI.COMM_WORLD)   # MPI: a node-wide collective, so its ranks are past MPI_Init
    unlink_node_files()
    _setup = MpiSetup(
        thread_level_requested=thread_level,
        thread_level_provided=names.get(MPI.Query_thread(), str(MPI.Query_thread())),
        progress_throttle=tuning["progress_throttle"] and library.startswith("MPICH"),
        yield_when_idle=tuning["yield_when_idle"] and library.startswith("Open MPI"),
        local_ranks=cores.local_ranks,
        cores=cores.node,
        rank_cores=cores.own,
        oversubscribed=cores.oversubscribed,
        library_version=library,
        world_size=MPI.COMM_WORLD.Get_size(),
    )
    return _setup
