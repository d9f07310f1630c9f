"""torch.distributed's process group, started by dimd from the MPI job: NCCL on GPUs, gloo on CPUs.

    group = start_group(comm, "nccl", device)      # collective; no MASTER_ADDR or MASTER_PORT to set
    pending = group.start(bucket, average=True)    # the mean of ``bucket`` over the ranks, in place, started
    ...                                            # (backward goes on meanwhile)
    pending.wait()                                 # GPU: the caller's stream waits for it; CPU: the caller does
    group.close()

One implementation for both backends; the backend is the only difference.
The rendezvous (:func:`dimd.allreduce.rendezvous.open_store`) is torch's
TCPStore on rank 0, at an address and port broadcast over MPI. Then
``init_process_group`` on that store (NCCL's communicator formed at once, on
the rank's GPU) and one small allreduce, all within the rendezvous timeout:
a rank that cannot reach rank 0's store, or a pair of ranks that cannot
reach each other, ends the job with one line instead of waiting for
torch's 10 or 30 minutes.

:meth:`TorchGroup.start` is what :class:`dimd.train.buckets.GradientBuckets`
calls for each bucket as backward completes it: ``all_reduce(async_op=True)``
enqueues the collective on the backend's own stream (NCCL: an internal
stream that first waits for the work queued on the caller's stream, so the
bucket's gradients are written) or its own threads (gloo) and returns at
once, as DDP's reducer does. NCCL averages in the collective
(``ReduceOp.AVG``, no pass of its own over the gradients); gloo has no AVG, so
its ``wait`` divides after the sum.

The group is torch's default group, so a script's own
``torch.distributed`` calls reach it too. Users of one backend share it:
two wrapped models in one script, or a bench of several algorithms, start it
once; it ends with its last user's :meth:`TorchGroup.close`. A default
group started by someone else is refused in one line (``algorithm="torch"``
reduces on it instead).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from dimd.allreduce.base import AllreduceError
from dimd.allreduce.rendezvous import RENDEZVOUS_HINT, RENDEZVOUS_TIMEOUT, first_line, open_store
from dimd.checks import Rule
from dimd.errors import DimdError

#: The torch.distributed backends dimd starts from MPI, by the name of their allreduce algorithm.
BACKENDS = ("nccl", "gloo")

#: A backend's collectives time out after this when the job's stall timeout is 0 ("wait forever"):
#: torch always has a timeout, and NCCL's watchdog ends the process at it.
_NO_TIMEOUT = timedelta(days=7)
#: How much longer than rank 0 the other ranks wait out a stalled rendezvous: rank 0's line, its grace and its
#: MPI_Abort reaching them through the launcher.
_SPEAKS_FIRST_S = 5.0   # a loaded machine delays the abort; only a job whose rank 0 cannot speak waits it out


def nccl_needs_a_gpu(device: str) -> Rule:
    """The rule "nccl needs a GPU": ``device`` is a config's choice ("auto": not known yet) or a torch device's
    type. The one wording of the config's refusal, the run's, and :class:`dimd.DistributedGradients`'s."""
    on = device != "cpu"
    return Rule(on, f"this rank computes on {'a GPU' if on else 'the CPU'}", "allreduce", "nccl reduces tensors "
                "on GPUs and this rank computes on the CPU: name gloo (the same path on the CPU) or a host algorithm")


def backend_problem(backend: str, device: Any) -> str | None:
    """Why this rank cannot start ``backend`` for tensors on ``device`` (a torch.device), or None."""
    import torch
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise DimdError(f"unknown torch.distributed backend {backend!r}; dimd starts {', '.join(BACKENDS)}")
    if not dist.is_available():
        return f"this torch build ({torch.__version__}) has no torch.distributed, so no {backend}"
    if backend == "gloo":
        return None if dist.is_gloo_available() else f"this torch build ({torch.__version__}) has no gloo"
    nccl = nccl_needs_a_gpu(device.type)
    if not nccl.on:
        return nccl.problem
    if not dist.is_nccl_available():
        return (f"this torch build ({torch.__version__}) has no NCCL: install a CUDA build of torch, or name "
                f"gloo or a host algorithm")
    return None


def shared_gpu_problem(comm: Any, device: Any) -> str | None:
    """Collective over ``comm``: why some ranks of a node would share a GPU (NCCL refuses that), or None.

    GPUs are told apart by their UUID (:func:`dimd.gpus.gpu_identity`), not CUDA's index: under a per-rank
    binding every rank's GPU is ``cuda:0``. Every rank gets the same answer.
    """
    from mpi4py import MPI

    from dimd.gpus import gpu_identity, shared_gpu

    mine = gpu_identity(device) if device.type == "cuda" else None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())   # MPI: this node's ranks
    try:
        gpus = local.allgather(mine)
        ranks = local.allgather(comm.Get_rank())
    finally:
        local.Free()
    shared = shared_gpu(ranks, gpus)
    problem = None
    if shared is not None:
        gpu, on = shared
        problem = (f"ranks {', '.join(map(str, on[:-1]))} and {on[-1]} on {socket.gethostname()} share GPU {gpu}: "
                   f"nccl needs a GPU of its own for each rank; start at most one rank per GPU")
    return next((p for p in comm.allgather(problem) if p), None)   # MPI: every node's answer


def group_problem(comm: Any, backend: str, device: Any) -> str | None:
    """Collective over ``comm``: why ``backend`` cannot run here (a rank without a GPU or NCCL, ranks sharing a
    GPU, a torch build without gloo), or None; the same answer on every rank."""
    problem = next((p for p in comm.allgather(backend_problem(backend, device)) if p), None)   # MPI: every rank's
    if problem is None and backend == "nccl":
        problem = shared_gpu_problem(comm, device)
    return problem


class StartedReduction:
    """A started collective; :meth:`wait` makes its result visible to the caller."""

    def __init__(self, work: Any, after: Callable[[], None] | None = None) -> None:
        self._work = work
        self._after = after

    def wait(self) -> None:
        """GPU (NCCL): the caller's current stream waits for the collective (the host does not);
        CPU (gloo): the caller's thread waits."""
        self._work.wait()
        if self._after is not None:
            self._after()


@dataclass
class TorchGroup:
    """torch.distributed's default process group over an MPI communicator's ranks, in their order."""

    backend: str
    world_size: int
    device: Any                         # the torch.device its tensors live on
    address: str | None = None          # the rendezvous, when dimd started it (None: the caller's group)
    owned: bool = False                 # dimd started it and destroys it at the last close()
    _users: int = field(default=1, repr=False)

    def start(self, tensor: Any, average: bool = False) -> StartedReduction:
        """Start summing (``average``: averaging) a contiguous ``tensor`` over the ranks, in place; return at once."""
        import torch.distributed as dist

        if average and self.backend == "nccl":
            return StartedReduction(dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=True))  # MPI: the mean
        work = dist.all_reduce(tensor, async_op=True)   # MPI: the sum over the group's ranks
        if average and self.world_size > 1:
            return StartedReduction(work, lambda: tensor.div_(self.world_size))
        return StartedReduction(work)

    def reduce_array(self, array: np.ndarray) -> None:
        """Sum a 1-D numpy array in place, waiting for it (the registry's form; through the device for NCCL)."""
        import torch

        host = torch.from_numpy(array)
        if self.device.type == "cpu" or self.backend == "gloo":
            self.start(host).wait()
            return
        on_device = host.to(self.device)
        self.start(on_device).wait()
        host.copy_(on_device)   # waits for the stream, which waited for the collective

    def close(self) -> None:
        """The last user of a group dimd started destroys it; a caller's group stays."""
        self._users -= 1
        if self._users > 0 or not self.owned:
            return
        import torch.distributed as dist

        if _started.get(self.backend) is self:
            del _started[self.backend]
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "TorchGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The group dimd started, per backend (one default group per process: at most one entry).
_started: dict[str, TorchGroup] = {}


def started_group(backend: str) -> TorchGroup | None:
    """The group of ``backend`` that dimd started and that is still open, if any."""
    return _started.get(backend)


def backend_timeout(stall_timeout: float) -> timedelta:
    """The backend's own collective timeout: beyond the job's stall timeout, so dimd's line comes first."""
    return timedelta(seconds=stall_timeout) + RENDEZVOUS_TIMEOUT if stall_timeout else _NO_TIMEOUT


def rendezvous_timeout(stall_timeout: float) -> timedelta:
    """How long the ranks wait for each other to meet: :data:`RENDEZVOUS_TIMEOUT`, or the stall timeout if shorter."""
    if stall_timeout and stall_timeout < RENDEZVOUS_TIMEOUT.total_seconds():
        return timedelta(seconds=stall_timeout)
    return RENDEZVOUS_TIMEOUT


def start_group(comm: Any, backend: str, device: Any = None, *, stall_timeout: float = 600.0) -> TorchGroup:
    """Collective over ``comm``: torch.distributed's default group with ``backend``, started from MPI.

    ``device``: the torch.device this rank reduces on (its own GPU for nccl;
    default: the current CUDA device for nccl, the CPU for gloo).
    ``stall_timeout``: the job's (:mod:`dimd.stall`); the rendezvous waits at
    most :func:`rendezvous_timeout` of it and the backend's collectives time
    out after :func:`backend_timeout`. Every problem is one line on every
    rank: no GPU for a rank, NCCL missing, ranks sharing a GPU, a default
    group someone else started, a rendezvous that cannot complete.
    """
    import torch

    from dimd.mpi import agree_or_raise

    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" and torch.cuda.is_available()
                  else torch.device("cpu"))
    device = torch.device(device)
    mine = _started.get(backend)
    agree_or_raise(comm, _existing_group_problem(comm, mine))   # MPI: every rank holds the same groups
    if mine is not None:
        mine._users += 1
        return mine
    agree_or_raise(comm, group_problem(comm, backend, device))   # MPI: a rank without a GPU or NCCL stops every rank
    group = TorchGroup(backend, comm.Get_size(), device, owned=True)
    group.address = _rendezvous(comm, group, rendezvous_timeout(stall_timeout), backend_timeout(stall_timeout))
    _started[backend] = group
    return group


def _rendezvous(comm: Any, group: TorchGroup, timeout: timedelta, collectives: timedelta) -> str:
    """Collective: the store, ``init_process_group`` on it and a first allreduce, each phase within ``timeout``.

    torch's C++ logs every retry of a connection with a stack trace, so its
    stderr is silenced meanwhile; what went wrong is one line. A phase that
    outlasts ``timeout`` on some rank (a blocked port, an address the other
    nodes cannot reach: torch's retries, or its backend's set-up, would wait
    in C++ deaf to signals) ends the job from the watchdog's thread.
    """
    import torch
    import torch.distributed as dist

    from dimd.mpi import agree_or_raise
    from dimd.stall import StallWatchdog, end_job

    backend, device = group.backend, group.device
    seconds = timeout.total_seconds()
    quiet = SilencedStderr()
    hint = f"{RENDEZVOUS_HINT}; `stall_timeout` bounds this wait, up to {RENDEZVOUS_TIMEOUT.total_seconds():g} s"

    def stalled(message: str) -> None:
        quiet.speak()   # torch's C++ would log a connection's next retry after dimd's line: it stays silenced
        end_job(comm, f"{backend}'s rendezvous did not complete: {message} ({hint})")

    # the other ranks give rank 0 a moment to speak first: its line ends the job, one line, not one per rank
    patience = seconds + (0.0 if comm.Get_rank() == 0 else _SPEAKS_FIRST_S)
    with StallWatchdog(patience if comm.Get_size() > 1 else 0, stalled) as watchdog, quiet:
        with watchdog.waiting("the connection to rank 0's rendezvous"):
            store, address = open_store(comm, timeout)   # MPI: rank 0's address and port, broadcast
        with watchdog.waiting(f"{backend}'s set-up over the rendezvous at {address}"):
            problem = None
            try:
                dist.init_process_group(backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size(),
                                        timeout=collectives, device_id=device if backend == "nccl" else None)
                check = torch.ones(1, device=device)
                group.start(check).wait()   # MPI: the first collective: every pair of ranks is connected
                if float(check) != comm.Get_size():
                    problem = f"{backend}'s first allreduce gave {float(check):g} over {comm.Get_size()} ranks"
            except (RuntimeError, ValueError) as exc:   # torch's DistStoreError and DistNetworkError are RuntimeErrors
                problem = f"{backend}'s rendezvous at {address} failed on rank {comm.Get_rank()}: {first_line(exc)}"
            agree_or_raise(comm, problem)   # MPI: every rank stops with the first rank's reason
    return address


class SilencedStderr:
    """File descriptor 2 to /dev/null for a while (torch's C++ logging), with Python's ``sys.stderr`` able to
    speak through it (:meth:`speak`, from any thread) while torch's C++ stays silenced."""

    def __init__(self) -> None:
        self._saved: int | None = None
        self._python: Any = None   # sys.stderr as it was before speak()
        self._lock = threading.Lock()

    def __enter__(self) -> "SilencedStderr":
        sys.stderr.flush()
        self._saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        return self

    def speak(self) -> None:
        """Python's writes to the real stderr again, file descriptor 2 still silenced: a job that ends from the
        watchdog says its one line while torch's C++ goes on logging its retries until the process ends."""
        with self._lock:
            if self._saved is not None and self._python is None:
                self._python = sys.stderr
                sys.stderr.flush()
                sys.stderr = os.fdopen(os.dup(self._saved), "w", buffering=1)

    def restore(self) -> None:
        with self._lock:
            if self._python is not None:
                sys.stderr.flush()
                sys.stderr.close()
                sys.stderr, self._python = self._python, None
            if self._saved is not None:
                os.dup2(self._saved, 2)
                os.close(self._saved)
                self._saved = None

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _existing_group_problem(comm: Any, mine: TorchGroup | None) -> str | None:
    """Why dimd cannot start or share a group over ``comm`` (another default group is up), or None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if mine is not None and dist.get_world_size() == comm.Get_size() and dist.get_rank() == comm.Get_rank():
        return None   # dimd's own, over the same ranks: shared
    return (f"a torch.distributed default group ({dist.get_backend()}, {dist.get_world_size()} ranks) is already "
            f"initialised; reduce on it with algorithm 'torch', or destroy_process_group() it first")


def group_allreduce(backend: str) -> Callable[[np.ndarray, Any], None]:
    """The registry's function for ``backend``: a numpy buffer summed on the group dimd started."""
    def run(buf: np.ndarray, comm: Any) -> None:
        group = _started.get(backend)
        if group is None:
            raise AllreduceError(f"allreduce algorithm {backend!r} runs on the torch.distributed group dimd starts: "
                                 f"call dimd.allreduce.start_group(comm, {backend!r}) first (dimd train and "
                                 f"DistributedGradients start it themselves)")
        group.reduce_array(buf)

    run.__name__ = f"{backend}_allreduce"
    return run


