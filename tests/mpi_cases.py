"""MPI test cases: one function per case, run on real ranks under ``python -m mpi4py``.

Each case is a small MPI program that a test starts on N ranks and then checks
by its output and exit status; from the repository root::

    mpiexec -n 3 python -m mpi4py tests/mpi_cases.py allreduce_sweep ring,tree
    mpiexec -n 2 python -m mpi4py tests/mpi_cases.py sgd_step_equals_global_batch mpi ring
    python tests/mpi_cases.py --list

and from a test, through ``conftest.mpi_run`` (which honours ``$MPIEXEC``)::

    @pytest.mark.mpi
    def test_ring_sums():
        proc = mpi_run("allreduce_sweep", 3, "ring")
        assert proc.returncode == 0, proc.stderr

``python -m mpi4py`` calls ``MPI_Abort`` when a rank ends with an uncaught
exception, so a failed ``assert`` on any rank ends the whole job at once, its
traceback on stderr, instead of leaving the other ranks waiting in a collective
until the test's timeout.

A new case is a function decorated with :func:`case`: its positional
arguments arrive as strings from the command line, it starts MPI through
:func:`world` (as dimd does, before ``mpi4py.MPI`` is imported), asserts what it
can on every rank, and prints with :func:`say` what the test should check.
Keep cases in the section of their stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import zlib
from typing import Any, Callable

#: name -> case function, in the order they are defined.
CASES: dict[str, Callable[..., None]] = {}


def case(function: Callable[..., None]) -> Callable[..., None]:
    """Register ``function`` as a case, named as the function is."""
    CASES[function.__name__] = function
    return function


def world(thread_level: str = "single") -> Any:
    """``MPI.COMM_WORLD``, with MPI started the way dimd starts it (thread level, progress throttle)."""
    from dimd.mpi import init_mpi

    init_mpi(thread_level)
    from mpi4py import MPI

    return MPI.COMM_WORLD


def say(line: str) -> None:
    """Print ``line`` in one write and flush it: ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# -- starting and ending jobs -------------------------------------------------------------

@case
def mpi_command_setup() -> None:
    """Under dimd's ``mpi_command``, every rank says its thread level and throttle, then ``done``.

        mpiexec -n 4 python -m mpi4py tests/mpi_cases.py mpi_command_setup
        -> level funneled throttle True yield False oversubscribed True (MPICH)
           (x4, when 4 ranks outnumber the cores; under Open MPI: throttle False yield True)
           done 0 ... done 3
    """
    from dimd.commands.mpi_job import mpi_command

    @mpi_command("funneled")
    def job(comm: Any, mpi_setup: Any) -> None:
        say(f"level {mpi_setup.thread_level_provided} throttle {mpi_setup.progress_throttle} "
            f"yield {mpi_setup.yield_when_idle} oversubscribed {mpi_setup.oversubscribed} "
            f"({mpi_setup.library_version.split()[0]})")
        comm.Barrier()
        say(f"done {comm.rank}")

    job()


@case
def one_rank_fails(collective: str, failing_rank: str, dataset: str = "") -> None:
    """Under dimd's ``mpi_command``, one rank fails while the others wait in a collective.

    The collective is ``barrier`` or ``shuffle`` (the failing rank raises a
    DimdError first; the shuffle needs a packed DATASET), ``allreduce`` (the
    failing rank hands the ring a read-only buffer, and the library refuses it)
    or ``agreed-barrier`` (the failing rank alone raises an error meant to be
    raised by every rank at once, as if a handler had let the others go on;
    the ranks wait 2 s for each other, then the job is aborted).
    dimd must end the whole job with that rank's one-line error, no rank says ``done``::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py one_rank_fails barrier 2
        -> stderr: dimd: error: rank 2: gives up before the barrier
        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py one_rank_fails shuffle 1 packed/sample
        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py one_rank_fails allreduce 2
        -> stderr: dimd: error: rank 2: allreduce needs a writeable buffer
    """
    import numpy as np

    from dimd.allreduce import allreduce
    from dimd.commands import mpi_job
    from dimd.commands.mpi_job import mpi_command
    from dimd.errors import DimdError
    from dimd.mpi import AgreedError
    from dimd.shuffle import DistributedStore

    failing = int(failing_rank)
    mpi_job.AGREED_EXIT_S = 2.0

    @mpi_command("funneled")
    def job(comm: Any, mpi_setup: Any) -> None:
        if collective == "barrier":
            if comm.rank == failing:
                raise DimdError("gives up before the barrier")
            comm.Barrier()
        elif collective == "shuffle":
            store = DistributedStore.load(dataset, comm)
            if comm.rank == failing:
                raise DimdError("gives up before the shuffle")
            store.shuffle(0, 0)                  # the others wait in its Alltoallv
        elif collective == "allreduce":
            buf = np.ones(1000)
            buf.flags.writeable = comm.rank != failing
            allreduce(buf, comm, "ring")
        elif collective == "agreed-barrier":
            if comm.rank == failing:
                raise AgreedError("gives up alone before the barrier")
            comm.Barrier()
        else:
            raise ValueError(f"no collective {collective!r}: barrier, shuffle, allreduce or agreed-barrier")
        say(f"done {comm.rank}")

    job()


@case
def agreed_only_over_the_whole_job() -> None:
    """A problem all ranks of the job raise is an AgreedError (the job may end in order); one all ranks
    of a group raise is a plain DimdError (the other groups know nothing: the job must be aborted)::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py agreed_only_over_the_whole_job
        -> agreed 0, agreed 1
    """
    from dimd.errors import DimdError
    from dimd.mpi import AgreedError, agreed

    comm = world()
    group = comm.Split(comm.rank, 0)   # a group of one rank each
    assert type(agreed(comm, "x")) is AgreedError
    assert type(agreed(group, "x")) is DimdError
    group.Free()
    say(f"agreed {comm.rank}")


@case
def dimd_warned_right_after_mpi_starts(ranks: str, *args: str) -> None:
    """``dimd ARGS``, with a SIGUSR1 (a scheduler's time-limit warning) sent just after MPI_Init to each rank
    of RANKS (``all``, or comma-separated ranks: the warning reaching the others later, or never).

    MPI_Init puts its own handler on SIGUSR1; dimd's must already be there, so the run stops cleanly::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py dimd_warned_right_after_mpi_starts all train data ...
        -> stopped by SIGUSR1 after step 1; checkpoint ...
    """
    import os
    import signal

    from dimd.cli import main
    from dimd.commands import mpi_job

    started = mpi_job.init_mpi

    def init_then_warn(level: Any) -> Any:
        setup = started(level)
        from mpi4py import MPI

        if ranks == "all" or str(MPI.COMM_WORLD.Get_rank()) in ranks.split(","):
            os.kill(os.getpid(), signal.SIGUSR1)
        return setup

    mpi_job.init_mpi = init_then_warn
    main(list(args), prog_name="dimd")


@case
def assert_fails_on_one_rank(failing_rank: str) -> None:
    """A plain ``assert`` fails on one rank while the others wait in a barrier; the harness ends the job.

    No dimd error handling is involved: ``python -m mpi4py`` aborts the job::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py assert_fails_on_one_rank 1
        -> stderr: AssertionError: rank 1 of 3 disagrees
    """
    comm = world()
    assert comm.rank != int(failing_rank), f"rank {comm.rank} of {comm.size} disagrees"
    comm.Barrier()
    say(f"done {comm.rank}")


@case
def a_peer_stops_answering(timeout: str) -> None:
    """Rank 1 stops calling collectives before step 3 (as a rank behind a dead link looks to the others).

    Rank 0 waits in step 3's allreduce; its stall watchdog ends the whole job after TIMEOUT seconds::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py a_peer_stops_answering 1
        -> stderr: dimd: error: rank 0 on HOST: no progress for 1 s in the allreduce of step 3; a peer may
           be unreachable (...)
    """
    import time

    import numpy as np
    from mpi4py import MPI

    from dimd.stall import StallWatchdog, job_ender

    comm = world("serialized")
    gradients = np.ones(1000)
    with StallWatchdog(float(timeout), job_ender(comm)) as watchdog:
        for step in (1, 2, 3):
            if comm.rank == 1 and step == 3:
                time.sleep(300)                        # gone: never reaches the allreduce
            with watchdog.waiting(f"the allreduce of step {step}"):
                comm.Allreduce(MPI.IN_PLACE, gradients)
            say(f"rank {comm.rank} step {step}")
    say(f"done {comm.rank}")


# -- shuffle and loader ----------------------------------------------------------------

@case
def send_buffer_across_shuffles(dataset: str, rounds: str) -> None:
    """Shuffle DATASET ROUNDS times; each round says whether it gathered into the last round's send buffer.

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py send_buffer_across_shuffles packed/sample 4
        -> {"rank": 0, "rounds": [[bytes sent, capacity before, same buffer], ...]}   (one line per rank)

    A new buffer is allowed only where the bytes leaving outgrew the one held.
    """
    from dimd.shuffle import DistributedStore

    store = DistributedStore.load(dataset, world())
    rounds_seen = []
    for r in range(int(rounds)):
        before = store._send
        stats = store.shuffle(seed=2, round=r)
        rounds_seen.append([stats.bytes_sent, len(before), store._send is before])
        assert len(store._send) >= stats.bytes_sent
    say(json.dumps({"rank": store.group_comm.Get_rank(), "rounds": rounds_seen}))


@case
def each_rank_loads_its_own_copy(*datasets: str) -> None:
    """Rank r loads DATASETS[r], as a job reads a copy of the set on each node's own disk.

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py each_rank_loads_its_own_copy a/train b/train
        -> rank 0: loaded 40 records     (one line per rank; copies that differ: rank 0: refused: <why>)
    """
    from dimd.mpi import AgreedError
    from dimd.shuffle import DistributedStore

    comm = world()
    try:
        store = DistributedStore.load(datasets[comm.rank], comm)
    except AgreedError as exc:   # every rank refuses alike, so the job can end in order
        say(f"rank {comm.rank}: refused: {exc}")
        return
    say(f"rank {comm.rank}: loaded {store.total} records")


@case
def loader_batches(dataset: str, groups: str) -> None:
    """Load DATASET in GROUPS groups, train an epoch, shuffle, train one more and evaluate one.

    The decoding workers read the load-order share in epoch 0 and the shuffled
    one after it, without restarting; the shuffle comes while epoch 1 is being
    read, and that iteration goes on. Rank 0 prints one JSON line: every rank's
    steps per epoch, how many training images rank 0 saw after the shuffle,
    whether any rank's workers restarted, whether every rank's iteration gave
    after the shuffle (its batches in flight then included) what a loader
    started on the shuffled store gives, and each rank's evaluation (global index, label, crc32 of the
    decoded image), for the test to check against the packed set::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py loader_batches packed/sample 1
        -> {"steps": [4, 4, 4], "seen": 16, "restarted": false, "continued": true, "pairs": [[[0, 2, 123], ...]]}
    """
    from dimd.shuffle import BatchLoader, DistributedStore

    comm = world("funneled")
    from mpi4py import MPI

    store = DistributedStore.load(dataset, comm, groups=int(groups))
    train = BatchLoader(store, batch_size=4, image_size=32, workers=2, seed=1)
    steps = comm.allgather(train.steps_per_epoch)
    for _ in train.epoch(0):
        pass
    workers = train.worker_pids
    def fingerprints(batches: Any) -> list[tuple[int, list[int]]]:
        return [(zlib.crc32(images.numpy().tobytes()), labels.tolist()) for images, labels in batches]

    in_flight = train.epoch(1)
    next(in_flight)                  # batches 1 and 2 of epoch 1 still decoding while the bytes move
    store.shuffle(seed=4, round=0)   # the workers move to the received share at this round boundary
    continued = fingerprints(in_flight)   # batches 1 on: the shuffled store's
    train.seek(1, 1)
    continued_as_started = comm.allreduce(int(continued == fingerprints(train.epoch(1))), op=MPI.MIN)
    train.seek(1)
    seen = sum(len(labels) for _, labels in train.epoch(1))
    restarted = bool(comm.allreduce(int(train.worker_pids != workers)))
    evaluation = BatchLoader(store, batch_size=5, image_size=32, train=False, workers=2)
    pairs: list[tuple[int, int, int]] = []
    for images, labels in evaluation.epoch(0):
        pairs += [(int(store.global_index[len(pairs) + j]), int(labels[j]),
                   zlib.crc32(images[j].numpy().tobytes())) for j in range(len(labels))]
    everything = comm.gather(pairs)
    if comm.rank == 0:
        say(json.dumps({"steps": steps, "seen": seen, "restarted": restarted,
                        "continued": bool(continued_as_started), "pairs": everything}))


@case
def loader_as_a_library(dataset: str, hold: str = "") -> None:
    """What a user's own script does, with no launcher: load DATASET, read one training epoch.

    Prints one JSON line: the crc32 of each batch's images and labels and the
    decoding workers' and its own process ids. With HOLD, then waits (for a test to kill it)::

        python tests/mpi_cases.py loader_as_a_library packed/sample
        -> {"batches": [[123, 456], ...], "workers": [4242, 4243], "pid": 4240}
    """
    import time

    from dimd.shuffle import BatchLoader, DistributedStore

    store = DistributedStore.load(dataset, world("funneled"))
    with BatchLoader(store, batch_size=8, image_size=24, workers=2, seed=3) as loader:
        batches = [(zlib.crc32(images.numpy().tobytes()), zlib.crc32(labels.numpy().tobytes()))
                   for images, labels in loader.epoch(0)]
        say(json.dumps({"batches": batches, "workers": loader.worker_pids, "pid": os.getpid()}))
        while hold:
            time.sleep(1)


# -- allreduce -------------------------------------------------------------------------

def sweep_sizes(ranks: int) -> list[int]:
    """Element counts around P and a few MiB, for :func:`allreduce_sweep` and its test."""
    return sorted({0, 1, 7, max(ranks - 1, 0), ranks + 1, 1000, (3 << 20) // 8 + 5})


@case
def allreduce_sweep(algorithms: str = "", colors: str = "") -> None:
    """Every standalone algorithm (or the comma-separated ALGORITHMS), on sizes around P and a few MiB, each dtype.

    ``colors`` sets the colour count of the algorithms that take one (multicolor's default is 4).

    Each result is checked against numpy's sum of every rank's input, and every
    rank must end with the same bits. Each rank prints a ``FAIL`` line per
    mismatch and then its count::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py allreduce_sweep ring,tree
        -> rank 0 checked 56 failed 0
           rank 1 checked 56 failed 0 ...
    """
    import numpy as np

    from dimd.allreduce import ALGORITHMS, STANDALONE, allreduce

    comm = world()
    P, rank = comm.Get_size(), comm.Get_rank()
    names = algorithms.split(",") if algorithms else list(STANDALONE)
    checked = failed = 0
    for name in names:
        # small segments so that the pipelined algorithms run many segments
        options = {"segment_bytes": 40000} if "segment_bytes" in ALGORITHMS[name].options else {}
        if colors and "colors" in ALGORITHMS[name].options:
            options["colors"] = int(colors)
        for count in sweep_sizes(P):
            for dtype in ("float32", "float64", "int32", "int64"):
                rng = np.random.default_rng([rank, count, len(name)])
                if dtype.startswith("int"):
                    mine = rng.integers(-1000, 1000, count).astype(dtype)
                else:
                    mine = rng.standard_normal(count).astype(dtype)
                every = np.empty((P, count), dtype)
                comm.Allgather(mine, every)
                expected = every.sum(axis=0, dtype=np.float64 if dtype.startswith("f") else dtype)
                allreduce(mine, comm, name, **options)
                same = np.empty((P, count), dtype)
                comm.Allgather(mine, same)
                ok = (np.allclose(mine, expected, rtol=1e-5, atol=1e-4) if dtype.startswith("f")
                      else np.array_equal(mine, expected))
                ok = ok and bool((same == same[0]).all())
                checked += 1
                if not ok:
                    failed += 1
                    say(f"FAIL rank {rank} {name} count {count} {dtype}")
    say(f"rank {rank} checked {checked} failed {failed}")


@case
def allreduce_tensors_and_options() -> None:
    """A CPU tensor averaged in place, every colour count on a 2-D array, and one agreed fastest algorithm.

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py allreduce_tensors_and_options
        -> rank 0 ok ring   (one line per rank, the same algorithm on each)
    """
    import numpy as np
    import torch

    from dimd.allreduce import ALGORITHMS, allreduce, choose_fastest

    comm = world()
    P, rank = comm.Get_size(), comm.Get_rank()
    # a CPU tensor, summed in place and averaged (what data-parallel training does)
    grads = torch.full((3, 5), float(rank + 1))
    out = allreduce(grads, comm, "multicolor", colors=2, average=True)
    assert out is grads
    assert torch.allclose(grads, torch.full((3, 5), (P + 1) / 2)), grads
    # a 2-D array and every colour count, including more colours than ranks
    for colors in (1, 2, 3, 7):
        grid = np.full((4, 33), rank, dtype=np.float64)
        allreduce(grid, comm, "multicolor", colors=colors, segment_bytes=8)
        assert (grid == P * (P - 1) / 2).all(), (colors, grid)
    best = choose_fastest(1 << 16, comm, np.float32, ["mpi", "ring", "tree"], iters=3)
    everyone = comm.allgather(best)
    assert len(set(everyone)) == 1 and best in ALGORITHMS, everyone
    say(f"rank {rank} ok {best}")


@case
def allreduce_message_counts(count: str, algorithms: str) -> None:
    """Count every message each rank sends and receives, per algorithm, on COUNT float32 ones.

    Each algorithm runs on a communicator that counts its point-to-point calls;
    rank 0 prints one JSON line: per algorithm, every rank's [messages, bytes]::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py allreduce_message_counts 245760 ring,tree
        -> {"ring": [[4, 655360], ...], "tree": [...]}
    """
    import numpy as np

    from dimd.allreduce import ALGORITHMS

    class Counting:
        def __init__(self, comm: Any) -> None:
            self.comm, self.messages, self.moved = comm, 0, 0

        def Get_size(self) -> int:
            return self.comm.Get_size()

        def Get_rank(self) -> int:
            return self.comm.Get_rank()

        def _count(self, buf: Any) -> None:
            self.messages += 1
            self.moved += np.asarray(buf).nbytes

        def Send(self, buf: Any, *a: Any) -> Any:
            self._count(buf)
            return self.comm.Send(buf, *a)

        def Recv(self, buf: Any, *a: Any) -> Any:
            self._count(buf)
            return self.comm.Recv(buf, *a)

        def Isend(self, buf: Any, *a: Any) -> Any:
            self._count(buf)
            return self.comm.Isend(buf, *a)

        def Irecv(self, buf: Any, *a: Any) -> Any:
            self._count(buf)
            return self.comm.Irecv(buf, *a)

        def Sendrecv(self, send: Any, dest: int, stag: int, recv: Any, source: int, rtag: int) -> Any:
            self._count(send)
            self._count(recv)
            return self.comm.Sendrecv(send, dest, stag, recv, source, rtag)

    comm = world()
    out = {}
    for name in algorithms.split(","):
        counting = Counting(comm.Dup())
        buf = np.ones(int(count), np.float32)
        ALGORITHMS[name].function(buf, counting, **ALGORITHMS[name].options)
        assert np.all(buf == comm.Get_size()), name
        out[name] = comm.gather([counting.messages, counting.moved])
    if comm.Get_rank() == 0:
        say(json.dumps(out))


# -- training --------------------------------------------------------------------------

@case
def sgd_step_equals_global_batch(*algorithms: str) -> None:
    """Three S-SGD steps on P ranks with batch b each, against one rank stepping on batch P*b.

    For each allreduce algorithm named, rank 0 prints how far the P-rank model is
    from the one-rank model (``diff``), how far the steps moved the weights
    (``moved``), and whether every replica holds the same weights::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py sgd_step_equals_global_batch mpi ring tree
        -> mpi diff 2.98e-08 moved 0.0113 identical True
           ring diff ...
    """
    import torch

    from dimd.allreduce import allreduce
    from dimd.train.models import build_model
    from dimd.train.sgd import SSGD, broadcast_state, make_optimizer, replicas_identical

    from dimd.host import available_cores

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(max(1, available_cores() // size))   # as dimd train does: ranks share the cores
    b = 6

    def engine(replicas: int, reduce: Callable[[Any], Any] | None) -> tuple[Any, SSGD]:
        torch.manual_seed(rank)           # different on purpose: the broadcast must fix it
        model = build_model("lenet", 10)
        broadcast_state(model, comm)
        opt = make_optimizer(model, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
        return model, SSGD(model, opt, reduce, replicas)

    g = torch.Generator().manual_seed(42)
    steps = [(torch.randn(size * b, 3, 32, 32, generator=g), torch.randint(0, 10, (size * b,), generator=g))
             for _ in range(3)]
    for algorithm in algorithms:
        model, sgd = engine(size, lambda a, algorithm=algorithm: allreduce(a, comm, algorithm))
        single, single_sgd = engine(1, lambda a: None)
        for images, labels in steps:
            mine = slice(rank * b, (rank + 1) * b)
            out = sgd.step([(images[mine], labels[mine])], lr=0.05)
            ref = single_sgd.step([(images, labels)], lr=0.05)
            assert out.samples == size * b and abs(out.loss_sum - ref.loss_sum) < 1e-3 * ref.loss_sum
        diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), single.parameters()))
        moved = max(float((p - q).detach().abs().max())
                    for p, q in zip(model.parameters(), engine(1, None)[0].parameters()))
        same = replicas_identical(model, comm)
        if rank == 0:
            say(f"{algorithm} diff {diff:.3g} moved {moved:.3g} identical {same}")


@case
def sgd_overlap_on_and_off_alike() -> None:
    """dimd train's S-SGD step (SSGD) with its buckets reduced during backward and after it: four
    steps each, LeNet, small buckets; rank 0 says whether the weights and the step figures are identical::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py sgd_overlap_on_and_off_alike
        -> buckets 9 identical True loss 27.6
    """
    import torch

    from dimd.allreduce import allreduce
    from dimd.train.models import build_model
    from dimd.train.sgd import SSGD, broadcast_state, make_optimizer

    comm = world("serialized")
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)

    def run(overlap: bool) -> tuple[Any, list, int]:
        torch.manual_seed(0)
        model = build_model("lenet", 10)
        broadcast_state(model, comm)
        opt = make_optimizer(model, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
        sgd = SSGD(model, opt, lambda a: allreduce(a, comm, "ring"), size, bucket_bytes=40_000, overlap=overlap)
        g = torch.Generator().manual_seed(rank)
        figures = [sgd.step([(torch.randn(6, 3, 32, 32, generator=g), torch.randint(0, 10, (6,), generator=g))],
                            lr=0.05) for _ in range(4)]
        sgd.buckets.close()
        return model, [(r.loss_sum, r.correct, r.samples) for r in figures], sgd.buckets.buckets

    (on, on_figures, buckets), (off, off_figures, _) = run(True), run(False)
    identical = on_figures == off_figures and all(torch.equal(p, q) for p, q in zip(on.parameters(), off.parameters()))
    if rank == 0:
        say(f"buckets {buckets} identical {identical} loss {on_figures[-1][0]:.3g}")


class BranchyNet:
    """Builds a model with odd parameter counts, a frozen layer and two branches a step may leave unused."""

    @staticmethod
    def build(seed: int = 0) -> Any:
        import torch
        from torch import nn

        class Branchy(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv2d(3, 5, 3)       # 135 + 5 parameters
                self.a = nn.Linear(180, 7)           # 1260 + 7
                self.b = nn.Linear(180, 7)
                self.frozen = nn.Linear(7, 7)
                self.frozen.requires_grad_(False)
                self.head = nn.Linear(7, 3)          # 21 + 3
                self.branch = "ab"                   # which branches forward uses

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.conv(x).relu().flatten(1)
                h = sum(getattr(self, name)(h) for name in self.branch)
                return self.head(self.frozen(h).relu())

        torch.manual_seed(seed)
        return Branchy()

    #: bucket sizes in bytes: one bucket, one per parameter, and cuts at every boundary in between
    BUCKET_BYTES = (0, 1, 16, 30, 100, 600, 5100, 6000, 10_000, 1 << 20)


def count_calls(owner: Any, name: str) -> list[None]:
    """Wrap ``owner.name`` so that each call appends to the returned list (then calls through)."""
    calls: list[None] = []
    wrapped = getattr(owner, name)

    def counted(*args: Any) -> Any:
        calls.append(None)
        return wrapped(*args)

    setattr(owner, name, counted)
    return calls


def local_gradients(model: Any, batches: list, branches: list[str]) -> Any:
    """This rank's summed gradients over ``batches`` by plain autograd, flat (zeros where none)."""
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    for (x, y), branch in zip(batches, branches):
        model.branch = branch
        F.cross_entropy(model(x), y).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters() if p.requires_grad])


@case
def distributed_gradients_match_flat_allreduce(*algorithms: str) -> None:
    """DistributedGradients against one flat MPI_Allreduce of plain autograd's gradients, averaged.

    For every bucket size of BranchyNet.BUCKET_BYTES, overlap on and off, and
    each algorithm: each rank leaves a different branch unused, a layer is
    frozen, and two of three backward passes run inside no_sync(). The
    gradients are compared as the last ``backward()`` returns, before any
    ``synchronize()``, which must then reduce nothing again. Rank 0 prints the
    largest difference per algorithm (0 at P = 2: sums of two are exact)::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py distributed_gradients_match_flat_allreduce mpi ring
        -> mpi configurations 20 max_diff 5.96e-08
    """
    import copy

    import numpy as np
    import torch
    from mpi4py import MPI

    from dimd.train.distributed import DistributedGradients

    comm = world("serialized")
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    branches = ["a", "b", "ab"] if rank % 2 == 0 else ["b", "b", "a"]   # rank 0 never uses b in pass 1...
    if rank == size - 1:
        branches = ["a", "a", "a"]          # ...and the last rank never uses b at all
    reference_model = BranchyNet.build()
    expected = local_gradients(reference_model, batches, branches).numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
    expected /= size
    for algorithm in algorithms:
        worst, configurations = 0.0, 0
        for bucket_bytes in BranchyNet.BUCKET_BYTES:
            for overlap in (True, False):
                model = copy.deepcopy(reference_model)
                grads = DistributedGradients(model, comm, algorithm=algorithm, overlap=overlap,
                                             bucket_mb=bucket_bytes / (1 << 20))
                reductions = count_calls(grads.buckets, "reduce")
                model.zero_grad(set_to_none=True)
                for i, ((x, y), branch) in enumerate(zip(batches, branches)):
                    model.branch = branch
                    with grads.no_sync() if i < 2 else contextlib.nullcontext():
                        torch.nn.functional.cross_entropy(model(x), y).backward()
                assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
                got = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]).numpy()
                reduced = len(reductions)
                grads.synchronize()
                assert reduced == grads.buckets.buckets == len(reductions), (reduced, len(reductions))
                diff = float(np.abs(got - expected).max())
                assert diff <= (0.0 if size == 2 else 1e-6 * float(np.abs(expected).max())), (
                    algorithm, bucket_bytes, overlap, diff)
                worst, configurations = max(worst, diff), configurations + 1
                grads.close()
        if rank == 0:
            say(f"{algorithm} configurations {configurations} max_diff {worst:.3g}")


@case
def overlap_on_and_off_train_alike(algorithm: str = "ring") -> None:
    """Nine SGD steps (momentum, weight decay, gradients clipped between backward and step, as in a DDP
    script) with overlap on and off.

    Each rank leaves a branch unused in some steps; one step accumulates two passes inside no_sync()
    and another finds one rank with no backward pass at all. A layer is frozen after wrapping. Two backward
    passes raise half-way on every rank, and the script skips those steps: after the first it goes on to a
    step that starts inside no_sync(); after the second it drops the pass with zero_grad() and makes an MPI
    call of its own. Rank 0 prints whether the two runs' weights are bit-identical and whether every rank
    holds the same weights::

        mpiexec -n 3 python -m mpi4py tests/mpi_cases.py overlap_on_and_off_train_alike ring
        -> identical True replicas True moved 0.0731
    """
    import torch
    import torch.nn.functional as F

    from dimd.train.distributed import DistributedGradients
    from dimd.train.sgd import replicas_identical

    comm = world("serialized")
    rank = comm.Get_rank()
    torch.set_num_threads(1)

    def train(overlap: bool) -> Any:
        model = BranchyNet.build(seed=rank)   # different on purpose: the broadcast must fix it
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9,
                                    weight_decay=0.01)
        grads = DistributedGradients(model, comm, algorithm=algorithm, overlap=overlap, bucket_mb=0.001,
                                     optimizer=optimizer)
        broken = []   # while it holds an item, the conv layer's gradient raises: the heads' buckets started first

        def backward_breaks(grad: torch.Tensor) -> None:
            if broken:
                raise ValueError("a broken backward pass")

        def hook_output(layer: Any, inputs: Any, out: torch.Tensor) -> None:
            out.register_hook(backward_breaks)

        model.conv.register_forward_hook(hook_output)
        g = torch.Generator().manual_seed(7 + rank)
        for step in range(9):
            model.branch = "ab" if (step + rank) % 3 else "a"
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            optimizer.zero_grad()
            if step == 2:
                model.a.bias.requires_grad_(False)   # frozen after wrapping: weight decay must not move it
                frozen = model.a.bias.clone()
            if step in (5, 7):
                broken.append(True)
                try:
                    F.cross_entropy(model(x), y).backward()
                except ValueError:
                    broken.clear()
                    if step == 7:
                        grads.zero_grad()   # drops the pass now: the script's own MPI call is safe after it
                        comm.allreduce(1)
                    continue
            if step == 3:     # every pass accumulates inside no_sync(); the step reduces the sum
                with grads.no_sync():
                    F.cross_entropy(model(x), y).backward()
                    F.cross_entropy(model(2 * x), y).backward()
            elif step == 6:   # after a raised pass: the first pass inside no_sync(), the second outside it
                with grads.no_sync():
                    F.cross_entropy(model(x), y).backward()
                F.cross_entropy(model(2 * x), y).backward()
            elif step != 4 or rank != 1:   # at step 4 rank 1 runs no backward pass: it takes part as zeros
                F.cross_entropy(model(x), y).backward()
            if step != 4:   # (rank 1's gradients are averaged only at the step there: nothing to clip before)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)   # reads and scales every .grad
            optimizer.step()
        grads.close()
        assert torch.equal(model.a.bias, frozen)
        return model

    on, off = train(True), train(False)
    identical = all(torch.equal(p, q) for p, q in zip(on.parameters(), off.parameters()))
    replicas = replicas_identical(on, comm)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(on.parameters(), BranchyNet.build().parameters()))
    if rank == 0:
        say(f"identical {identical} replicas {replicas} moved {moved:.3g}")


@case
def device_auto_where_one_rank_has_cuda() -> None:
    """``auto`` on a job where only rank 1 sees CUDA (faked): the CPU on every rank, and no rank left
    waiting in the node's GPU pairing::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py device_auto_where_one_rank_has_cuda
        -> devices cpu cpu
    """
    import torch

    from dimd.train.hardware import pick_device

    comm = world()
    if comm.Get_rank() == 1:
        torch.cuda.is_available = lambda: True
    devices = comm.gather(str(pick_device("auto", comm)))
    if comm.Get_rank() == 0:
        say("devices " + " ".join(devices))


@case
def raised_pass_then_accumulation(algorithm: str = "ring") -> None:
    """Every rank's backward pass raises half-way (caught); the next step accumulates a pass inside
    no_sync() and one outside. Its gradients must be the two passes' average over ranks, as plain autograd
    plus one MPI_Allreduce gives them: the raised pass dropped, the accumulated one kept::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py raised_pass_then_accumulation ring
        -> overlap True max_diff 0 overlap False max_diff 0
    """
    import numpy as np
    import torch
    from mpi4py import MPI
    from torch import nn

    from dimd.train.distributed import DistributedGradients

    comm = world("serialized")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(comm.Get_rank())
    xs = [torch.randn(6, 5, generator=g) for _ in range(3)]
    line = []
    for overlap in (True, False):
        torch.manual_seed(0)
        head, tail = nn.Sequential(nn.Linear(5, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 3))
        model = nn.Sequential(head, tail)
        expected = torch.cat([p.reshape(-1) for p in torch.autograd.grad(
            model(xs[1]).square().mean() + model(xs[2]).square().mean(), list(model.parameters()))]).numpy()
        comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
        expected /= comm.Get_size()
        grads = DistributedGradients(model, comm, algorithm=algorithm, overlap=overlap, bucket_mb=0.0001)

        def refuse(grad: torch.Tensor) -> None:
            raise ValueError("a refused batch")

        hidden = head(xs[0])
        hidden.register_hook(refuse)   # the tail's buckets start, the head's never come
        try:
            tail(hidden).square().mean().backward()
        except ValueError:
            pass
        model.zero_grad()
        with grads.no_sync():
            model(xs[1]).square().mean().backward()
        model(xs[2]).square().mean().backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        grads.close()
        line.append(f"overlap {overlap} max_diff {float(np.abs(got - expected).max()):.3g}")
    if comm.Get_rank() == 0:
        say(" ".join(line))


@case
def two_wrapped_models_in_one_backward(algorithm: str = "ring") -> None:
    """A GAN-like step: one backward pass through a generator and a discriminator, each wrapped with overlap.

    The discriminator has a branch rank 1 never uses (so the ranks complete its buckets in another order
    than the generator's) and batch norm with its statistics averaged (``sync_buffers``). The gradients as
    ``backward()`` returns are compared with plain autograd's, summed by one MPI_Allreduce::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py two_wrapped_models_in_one_backward ring
        -> steps 5 max_diff 0
    """
    import numpy as np
    import torch
    from mpi4py import MPI
    from torch import nn

    from dimd.train.distributed import DistributedGradients

    class Discriminator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 5), nn.Linear(3, 5)
            self.norm, self.out = nn.BatchNorm1d(5), nn.Linear(5, 1)
            self.use_b = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) + (self.b(x).tanh() if self.use_b else 0)
            return self.out(self.norm(h).relu())

    comm = world("serialized")
    torch.set_num_threads(1)
    generator, discriminator = BranchyNet.build(), Discriminator()
    discriminator.use_b = comm.Get_rank() != 1
    models = (generator, discriminator)
    grads = [DistributedGradients(generator, comm, algorithm=algorithm, bucket_mb=0.0005),
             DistributedGradients(discriminator, comm, algorithm=algorithm, bucket_mb=0.0001, sync_buffers=True)]
    g = torch.Generator().manual_seed(comm.Get_rank())
    worst, steps = 0.0, 5
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=g)
        for m in models:
            m.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as local:   # the same pass, by plain autograd on this rank alone
            for wrapped in grads:
                local.enter_context(wrapped.no_sync())
            discriminator(generator(x)).sum().backward()
        expected = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for m in models for p in m.parameters() if p.requires_grad]).numpy()
        comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
        expected /= comm.Get_size()
        for m in models:
            m.zero_grad(set_to_none=True)
        discriminator(generator(x)).sum().backward()
        got = torch.cat([p.grad.reshape(-1) for m in models for p in m.parameters() if p.requires_grad]).numpy()
        worst = max(worst, float(np.abs(got - expected).max()))
    for wrapped in grads:
        wrapped.close()
    if comm.Get_rank() == 0:
        say(f"steps {steps} max_diff {worst:.3g}")


@case
def torch_algorithm_sums_with_gloo() -> None:
    """The registry's ``torch`` algorithm over a gloo group set up over MPI: sums, and DistributedGradients on it.

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py torch_algorithm_sums_with_gloo
        -> torch sum ok gradients ok
    """
    import numpy as np
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from dimd.allreduce import allreduce
    from dimd.allreduce.gloo import gloo_reducer
    from dimd.train.distributed import DistributedGradients

    comm = world("serialized")
    rank, size = comm.Get_rank(), comm.Get_size()
    _, close = gloo_reducer(comm)
    try:
        for count in (1, 7, 100_003):
            mine = np.arange(count, dtype=np.float32) * (rank + 1)
            allreduce(mine, comm, "torch")
            assert np.array_equal(mine, np.arange(count, dtype=np.float32) * sum(range(1, size + 1))), count
        model = BranchyNet.build()
        x, y = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(rank)), torch.tensor([0, 1, 2, 0])
        expected = local_gradients(BranchyNet.build(), [(x, y)], ["ab"]).numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
        grads = DistributedGradients(model, comm, algorithm="torch", bucket_mb=0.002)
        F.cross_entropy(model(x), y).backward()
        grads.synchronize()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]).numpy()
        assert np.allclose(got, expected / size, rtol=1e-6, atol=1e-7)
        grads.close()
    finally:
        close()
    if rank == 0:
        say("torch sum ok gradients ok")


@case
def sixteen_mixed_skips_on_every_rank() -> None:
    """16-mixed S-SGD on P ranks: rank 1's gradients overflow in the second step (an inf in its batch).

    Every rank must skip that step, halve its loss scale and keep identical
    weights; rank 0 prints one JSON line: per step, skipped / finite / scale,
    and whether the weights moved and the replicas agree.
    """
    import torch

    from dimd.allreduce import allreduce
    from dimd.train.models import build_model
    from dimd.train.precision import Precision
    from dimd.train.sgd import SSGD, broadcast_state, make_optimizer, replicas_identical

    comm = world()
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    broadcast_state(model, comm)
    precision = Precision("16-mixed", torch.device("cpu"))
    sgd = SSGD(model, make_optimizer(model, lr=0.05, momentum=0.9, weight_decay=0.0),
               lambda a: allreduce(a, comm, "ring"), comm.Get_size(), precision=precision)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for step in range(3):
        images = torch.randn(4, 3, 32, 32, generator=g)
        if step == 1 and rank == 1:
            images[0, 0, 0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        result = sgd.step([(images, torch.randint(0, 10, (4,), generator=g))], 0.05)
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        steps.append({"skipped": precision.last_skipped, "finite": result.finite, "moved": moved,
                      "scale": precision.loss_scale.scale, "events": len(result.events)})
    same = replicas_identical(model, comm)
    everyone = comm.gather(steps)
    if rank == 0:
        say(json.dumps({"steps": steps, "ranks_agree": all(s == steps for s in everyone), "identical": same}))


def small_bn_model(classes: int = 5) -> Any:
    """A convolution, batch norm and a linear layer: quick, and it has running statistics."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes))


@case
def sma_distribution(learners_per_rank: str, compute: str = "loop", algorithm: str = "ring") -> None:
    """P ranks x K learners against one process with P*K learners fed the same batches.

    Rank 0 prints how far the distributed z (and, relatively, its averaged batch-norm
    statistics) is from the single-process one, how far three synchronisations moved z, and
    whether z is bit-identical on every rank::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py sma_distribution 2
        -> z diff 1.2e-08 buffers diff 3e-09 moved 0.03 identical True
    """
    import torch

    from dimd.allreduce import allreduce
    from dimd.train.sma import SMA

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    k = int(learners_per_rank)
    total, b = size * k, 3

    def sma(learners: int, world_size: int, reduce) -> SMA:
        torch.manual_seed(0)
        return SMA(small_bn_model(), reduce, world_size, learners=learners, alpha=None, momentum=0.9,
                   central_momentum=None, weight_decay=1e-3, compute=compute)

    g = torch.Generator().manual_seed(42)
    steps = [[(torch.randint(0, 255, (b, 3, 16, 16), dtype=torch.uint8, generator=g),
               torch.randint(0, 5, (b,), generator=g)) for _ in range(total)] for _ in range(3)]
    mine = sma(k, size, lambda a: allreduce(a, comm, algorithm))
    start = mine.z.clone()
    for batches in steps:
        result = mine.step(batches[rank * k:(rank + 1) * k], 0.05, sync=True)
        assert result.synced and result.samples == total * b, result
    mine.eval_model()
    identical = mine.identical(comm)
    if rank == 0:
        single = sma(total, 1, lambda a: None)
        for batches in steps:
            single.step(batches, 0.05, sync=True)
        single.eval_model()
        z_diff = float((mine.z - single.z).abs().max())
        buffers_diff = float(((mine.z_floats - single.z_floats).abs() / single.z_floats.abs().clamp(min=1)).max())
        moved = float((mine.z - start).abs().max())
        say(f"z diff {z_diff:.3g} buffers diff {buffers_diff:.3g} moved {moved:.3g} identical {identical}")


@case
def sma_losses_around_a_reshuffle(data: str) -> None:
    """SMA on ``data`` (a packed set in class order) twice at equal seeds: reshuffled at every epoch,
    and with every reshuffle after the first placement keeping the records where they are.

    Rank 0 prints each run's per-synchronisation training loss and each rank prints the
    classes its learners drew in epoch 1, one JSON line each::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py sma_losses_around_a_reshuffle colours
        -> {"run": "reshuffled", "losses": [...], "steps_per_epoch": 6}
           {"rank": 0, "epoch_1_classes": [7, 5, 6, 6]}
    """
    import numpy as np

    from dimd.shuffle import DistributedStore
    from dimd.train.config import TrainConfig
    from dimd.train.engine import Trainer

    comm = world()
    config = TrainConfig(train=data, val=data, model="resnet20", image_size=16, epochs=2, batch_size=4, momentum=0.0,
                         lr=0.05, lr_scaling=False, schedule="constant", decode_workers=1, threads=1,
                         allreduce="ring", sync="sma", learners=1)
    shuffle = DistributedStore.shuffle

    def keep_after_the_first_step(store: Any, seed: int, round: int) -> Any:
        if trainer.state.step == 0:
            return shuffle(store, seed, round)
        store.round = round                     # the reshuffle replaced by the identity
        return None

    def recording(trainer: Any) -> tuple[list, list]:
        """Each step's loss, and the label counts of the first epoch's steps on this rank."""
        step, losses, labels = trainer.strategy.step, [], []

        def recorded(batches: Any, lr: float, **options: Any) -> Any:
            result = step(batches, lr, **options)
            losses.append(result.loss_sum / result.samples)
            if len(labels) < trainer.steps_per_epoch:
                labels.append(np.bincount(np.concatenate([b[1].numpy() for b in batches]), minlength=4))
            return result

        trainer.strategy.step = recorded
        return losses, labels

    for run in ("reshuffled", "kept"):
        if run == "kept":
            DistributedStore.shuffle = keep_after_the_first_step  # type: ignore[method-assign]
        trainer = Trainer(config, comm)
        losses, labels = recording(trainer)
        trainer.run()
        if comm.Get_rank() == 0:
            say(json.dumps({"run": run, "losses": losses, "steps_per_epoch": trainer.steps_per_epoch}))
        if run == "reshuffled":
            say(json.dumps({"rank": comm.Get_rank(), "epoch_1_classes": np.sum(labels, axis=0).tolist()}))
    DistributedStore.shuffle = shuffle  # type: ignore[method-assign]


#: The communicator methods that wait for other ranks.
COMMUNICATING = frozenset({
    "Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw", "Barrier", "Bcast", "Gather",
    "Gatherv", "Iallreduce", "Ialltoallv", "Ibarrier", "Ibcast", "Irecv", "Isend", "Recv", "Reduce", "Scatter",
    "Scatterv", "Send", "Sendrecv", "allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "irecv",
    "isend", "recv", "reduce", "scatter", "send", "sendrecv"})


class WatchedComm:
    """``comm``, noting for every communicating call made while a stall watchdog runs whether it was marked a wait.

    Use it as a context manager: inside, :class:`dimd.stall.StallWatchdog` tells it when one runs.
    """

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.calls: list[tuple[str, bool]] = []
        self._running: list[Any] = []

    def __enter__(self) -> "WatchedComm":
        from dimd.stall import StallWatchdog

        enter, leave, running = StallWatchdog.__enter__, StallWatchdog.__exit__, self._running
        self._restore = enter, leave

        def entered(watchdog: Any) -> Any:
            running.append(watchdog)
            return enter(watchdog)

        def left(watchdog: Any, *exc: object) -> None:
            running.remove(watchdog)
            leave(watchdog, *exc)

        StallWatchdog.__enter__, StallWatchdog.__exit__ = entered, left  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from dimd.stall import StallWatchdog

        StallWatchdog.__enter__, StallWatchdog.__exit__ = self._restore  # type: ignore[method-assign]

    def unwatched(self) -> list[str]:
        """The names of the calls made outside every marked wait."""
        return sorted({name for name, marked in self.calls if not marked})

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._comm, name)
        if name not in COMMUNICATING:
            return attribute

        def noted(*args: Any, **kwargs: Any) -> Any:
            if self._running:
                self.calls.append((name, any(watchdog._what is not None for watchdog in self._running)))
            return attribute(*args, **kwargs)

        return noted


@case
def every_wait_of_training_is_watched(data: str) -> None:
    """Training runs (shuffles, evaluations, checkpoints; S-SGD, then SMA) make no call that waits for the
    other ranks outside the stall watchdog's marked waits: a peer lost there would hang the job for ever.
    (The allreduce algorithms talk on a private duplicate of the communicator, inside the marked step.)

    Each rank prints, per run, its count of communicating calls and those not marked::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py every_wait_of_training_is_watched colours
        -> {"sync": "ssgd", "rank": 0, "calls": 11, "unwatched": []}
    """
    import shutil
    import tempfile

    from dimd.train.config import TrainConfig
    from dimd.train.engine import Trainer

    comm = world("serialized")
    for sync in ("ssgd", "sma"):
        folder = comm.bcast(tempfile.mkdtemp(prefix="dimd-watched-") if comm.Get_rank() == 0 else None)
        config = TrainConfig(train=data, val=data, model="lenet", image_size=16, epochs=2, batch_size=4, lr=0.05,
                             decode_workers=1, threads=1, allreduce="ring", sync=sync, checkpoint_dir=folder,
                             shuffle_every=2)
        with WatchedComm(comm) as watched:
            Trainer(config, watched).run()
        say(json.dumps({"run": sync, "rank": comm.Get_rank(), "calls": len(watched.calls),
                        "unwatched": watched.unwatched()}))
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(folder)


@case
def every_wait_of_the_other_mpi_commands_is_watched(data: str) -> None:
    """``dimd shuffle`` after its load (verified), ``dimd bench-allreduce`` (checked, every standalone
    algorithm) and ``dimd plan-batch step-time`` (real batches) make no call that waits for the other ranks
    outside a marked wait. (``plan-batch convergence`` runs dimd train's engine.)

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py every_wait_of_the_other_mpi_commands_is_watched colours
        -> {"run": "shuffle", "rank": 0, "calls": 19, "unwatched": []}
    """
    from dimd.allreduce.bench import BenchConfig, run_bench
    from dimd.shuffle.rounds import ShuffleConfig, run_shuffle
    from dimd.train.plan.config import StepTimeConfig
    from dimd.train.plan.measure import measure_step_times

    comm = world("serialized")
    steps = StepTimeConfig(model="lenet", image_size=16, batch_sizes=(1, 2), steps=2, warmup=1, threads=1,
                           data=data, decode_workers=1)
    runs = {"shuffle": lambda c: run_shuffle(ShuffleConfig(dataset=data, rounds=2, verify=True), c),
            "bench-allreduce": lambda c: run_bench(BenchConfig(max_bytes=4096, factor=64, iters=2, check=True), c),
            "plan-batch step-time": lambda c: measure_step_times(steps, c)}
    for name, run in runs.items():
        with WatchedComm(comm) as watched:
            run(watched)
        say(json.dumps({"run": name, "rank": comm.Get_rank(), "calls": len(watched.calls),
                        "unwatched": watched.unwatched()}))


# -- plan-batch: the gradient noise scale and the convergence step ---------------------------

@case
def noise_scale_matches_offline_estimator(data: str) -> None:
    """The engine's B_simple equals :class:`NoiseScale` fed offline with the same gradients::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py noise_scale_matches_offline_estimator PACKED_SET
        -> ok 8 steps; B_simple per epoch ...

    Every rank trains lenet with ``noise_scale`` on and keeps a float64 copy of
    its gradient just before each allreduce (the buckets' ``synchronize`` is
    wrapped; the noise scale keeps overlap off, so nothing is reduced before it);
    rank 0 gathers the copies, feeds the estimator with norms computed from them
    in float64, and compares per epoch.
    """
    import numpy as np

    from dimd.train.buckets import GradientBuckets
    from dimd.train.config import TrainConfig
    from dimd.train.engine import train
    from dimd.train.noise import NoiseScale, noise_estimates_from_gradients

    comm = world("funneled")
    seen: list[Any] = []
    real_synchronize = GradientBuckets.synchronize

    def synchronize(self: GradientBuckets) -> None:   # this rank's gradient, as computed
        seen.append(self.flat.grads.detach().double().numpy().copy())
        real_synchronize(self)

    GradientBuckets.synchronize = synchronize  # type: ignore[method-assign]
    batch = 6
    config = TrainConfig(train=data, val=data, model="lenet", image_size=16, epochs=2, batch_size=batch, lr=0.1,
                         lr_scaling=False, schedule="constant", decode_workers=1, threads=1, noise_scale=True)
    result = train(config, comm)
    everyone = comm.gather(seen, root=0)
    if comm.Get_rank() != 0:
        return
    ranks = comm.Get_size()
    offline = NoiseScale()
    per_epoch = []
    for step in range(len(seen)):
        grads = np.stack([everyone[r][step] for r in range(ranks)])          # P x D
        local = float(np.mean(np.einsum("pd,pd->p", grads, grads)))
        mean = grads.mean(axis=0)
        offline.update(local, float(mean @ mean), batch, ranks)
        g2, _ = noise_estimates_from_gradients(grads, batch)   # the scalar form is the gradient form
        assert np.isclose(g2, (ranks * float(mean @ mean) - local) / (ranks - 1))
        if (step + 1) % result.steps_per_epoch == 0:
            per_epoch.append(offline.figures())
    assert len(per_epoch) == len(result.epochs) == 2
    for engine, expected in zip(result.epochs, per_epoch):
        assert engine.noise_steps == expected["noise_steps"]
        for key in ("noise_gradient_sqnorm", "noise_trace", "noise_scale"):
            got, want = getattr(engine, key), expected[key]
            assert (got is None) == (want is None), (key, got, want)
            if want is not None:
                assert np.isclose(got, want, rtol=1e-3, atol=1e-7), (key, got, want)
    assert result.epochs[-1].noise_scale is not None   # |G|^2's average has turned positive by then
    say(f"ok {len(seen)} steps; B_simple per epoch " + ", ".join(f"{e.noise_scale}" for e in result.epochs))


def score_by_law(n_inf: float, alpha: float, samples: int = 1) -> Callable[[Any], Any]:
    """A ``Trainer.evaluate`` whose top-1 is 1 once the run has taken N_inf + alpha/M steps, 0 before."""
    from dimd.train.evaluate import EvalResult

    def evaluate(trainer: Any) -> EvalResult:
        reached = trainer.state.step >= n_inf + alpha / trainer.global_batch
        return EvalResult(loss=0.0, top1=1.0 if reached else 0.0, top5=1.0, samples=samples, seconds=0.0)

    return evaluate


@case
def dimd_scored_by_known_law(n_inf: str, alpha: str, *args: str) -> None:
    """``dimd ARGS`` with validation top-1 replaced by a known law: 1 once a run has taken N_inf + alpha/M steps.

    The real engine trains; only the score is set, so ``plan-batch convergence``'s
    updates-to-target come out exactly::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py dimd_scored_by_known_law 3 32 plan-batch convergence ...
    """
    from dimd.cli import main
    from dimd.train.engine import Trainer

    Trainer.evaluate = score_by_law(float(n_inf), float(alpha))  # type: ignore[method-assign]
    main(list(args), prog_name="dimd")


@case
def dimd_with_validation_loss_nan_from_epoch(epoch: str, *args: str) -> None:
    """``dimd ARGS`` whose validation loss is NaN from the evaluation ending epoch ``epoch`` (1-based) on:
    the real engine trains and scores; only the loss sum of the scores is replaced::

        mpiexec -n 2 python -m mpi4py tests/mpi_cases.py dimd_with_validation_loss_nan_from_epoch 2 train ...
    """
    from dimd.cli import main
    from dimd.train import engine

    real, evaluations = engine.local_counts, []

    def counts(*positional: Any, **options: Any) -> Any:
        result = real(*positional, **options)
        evaluations.append(1)
        if len(evaluations) >= int(epoch):
            result[0] = float("nan")
        return result

    engine.local_counts = counts  # type: ignore[assignment]
    main(list(args), prog_name="dimd")


def main(argv: list[str] | None = None) -> None:
    """Run the case named by the first argument with the rest as its arguments (``--list``: the names)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--list"]:
        print("\n".join(CASES))
        return
    if not argv or argv[0] not in CASES:
        raise SystemExit(f"usage: python -m mpi4py {sys.argv[0]} CASE [ARG...]\n"
                         f"cases: {', '.join(CASES)}")
    CASES[argv[0]](*argv[1:])


if __name__ == "__main__":
    main()
