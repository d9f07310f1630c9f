"""The stall watchdog notices a wait for the other ranks that outlasts its timeout (dimd.stall).

The whole job it ends is tested on real ranks (test_mpi_setup.py) and across two hosts, one of them
cut off (tests/multihost/); here its clock is a counter the test moves by hand, and a real 2-rank
training run shows that each of its waits for the other ranks is one the watchdog sees.
"""

import json
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
from conftest import mpi_run
from mpi_case import case, say, world

from dimd.allreduce.bench import BenchConfig
from dimd.errors import DimdError
from dimd.shuffle.rounds import ShuffleConfig
from dimd.stall import StallWatchdog, stop_a_stuck_runtime
from dimd.train.config import TrainConfig
from dimd.train.plan.config import StepTimeConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_longer_than_the_timeout_is_reported_with_what_it_waited_for():
    clock = Clock()
    watchdog = StallWatchdog(30, lambda line: None, clock=clock)
    with watchdog.waiting("the allreduce of step 7"):
        clock.now += 29
        assert watchdog.stalled() is None
        clock.now += 2
        assert watchdog.stalled() == "no progress for 31 s in the allreduce of step 7; a peer may be unreachable"


def test_time_between_waits_is_not_a_stall():
    clock = Clock()
    watchdog = StallWatchdog(30, lambda line: None, clock=clock)
    with watchdog.waiting("the allreduce of step 1"):
        clock.now += 10
    clock.now += 1000                       # a slow decode, a long local evaluation: no peer is awaited
    assert watchdog.stalled() is None
    with watchdog.waiting("the allreduce of step 2"):
        clock.now += 10                     # each wait is timed from its own start
        assert watchdog.stalled() is None


def test_a_watchdog_watches_one_run_after_another():
    fired = threading.Event()
    clock = Clock()
    watchdog = StallWatchdog(5, lambda line: fired.set(), clock=clock, poll=0.01)
    with watchdog:
        pass
    with watchdog, watchdog.waiting("the barrier before step 1 at 8 images per rank"):
        clock.now += 6
        assert fired.wait(30)


def test_a_timeout_of_zero_never_reports_and_starts_no_thread():
    clock = Clock()
    watchdog = StallWatchdog(0, lambda line: None, clock=clock)
    with watchdog, watchdog.waiting("the shuffle of round 3"):
        clock.now += 10**6
        assert watchdog.stalled() is None
        assert watchdog._thread is None


def test_the_watchdog_thread_calls_on_stall_once():
    lines: list[str] = []
    fired = threading.Event()

    def on_stall(line: str) -> None:
        lines.append(line)
        fired.set()

    clock = Clock()
    with StallWatchdog(5, on_stall, clock=clock, poll=0.01) as watchdog, watchdog.waiting("the evaluation's allreduce"):
        clock.now += 6
        assert fired.wait(30)
    assert lines == ["no progress for 6 s in the evaluation's allreduce; a peer may be unreachable"]


@pytest.mark.parametrize("config", [lambda **kw: TrainConfig(train="t", val="v", **kw),
                                    lambda **kw: ShuffleConfig(dataset="t", **kw), BenchConfig,
                                    lambda **kw: StepTimeConfig(model="lenet", **kw)],
                         ids=["train", "shuffle", "bench-allreduce", "plan-batch step-time"])
@pytest.mark.parametrize("timeout", [-1, float("inf")])
def test_a_negative_or_endless_stall_timeout_is_refused_by_every_mpi_command(config, timeout):
    with pytest.raises(DimdError, match="stall_timeout"):
        config(stall_timeout=timeout)


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

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py every_wait_of_training_is_watched colours
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


@pytest.mark.mpi
def test_every_wait_of_a_training_run_is_watched(colour_set):
    """A collective outside the marked waits is where a lost peer would hang the job past any timeout."""
    proc = mpi_run(every_wait_of_training_is_watched, 2, str(colour_set), timeout=240, check=True)
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {(run["run"], run["rank"]) for run in runs} == {(s, r) for s in ("ssgd", "sma") for r in (0, 1)}
    assert all(run["calls"] > 0 and run["unwatched"] == [] for run in runs), runs


@case
def every_wait_of_the_other_mpi_commands_is_watched(data: str) -> None:
    """``dimd shuffle`` after its load (verified), ``dimd bench-allreduce`` (checked, every standalone
    algorithm) and ``dimd plan-batch step-time`` (real batches) make no call that waits for the other ranks
    outside a marked wait. (``plan-batch convergence`` runs dimd train's engine.)

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py every_wait_of_the_other_mpi_commands_is_watched colours
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


@pytest.mark.mpi
def test_every_wait_of_the_other_mpi_commands_after_their_load_is_watched(colour_set):
    """The load's reads may lag each other by any time, so its waits are not watched; everything after is."""
    proc = mpi_run(every_wait_of_the_other_mpi_commands_is_watched, 2, str(colour_set), timeout=120, check=True)
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    commands = ("shuffle", "bench-allreduce", "plan-batch step-time")
    assert {(run["run"], run["rank"]) for run in runs} == {(c, r) for c in commands for r in (0, 1)}
    assert all(run["calls"] > 0 and run["unwatched"] == [] for run in runs), runs


#: Open MPI's daemon (prted) as ``end_job`` meets it, stuck waiting for a lost host: a third SIGTERM ends it
#: (exit 1). It prints ``ready`` once named, then waits ARGV[1] seconds and exits 0.
STUCK_PRTED = """
import ctypes, signal, sys, time
ctypes.CDLL(None).prctl(15, b"prted", 0, 0, 0)   # PR_SET_NAME: /proc/PID/comm reads prted
terms = []
signal.signal(signal.SIGTERM, lambda *_: terms.append(1) or (len(terms) == 3 and sys.exit(1)))
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
"""


def prted(seconds: float) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", STUCK_PRTED, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    return process


def test_open_mpis_runtime_left_waiting_after_the_abort_is_stopped_with_three_sigterms():
    """After MPI_Abort, Open MPI's launcher and daemons wait for a lost host's daemon (16 minutes by default):
    the rank leaves a process behind that ends its parent so, once the grace is over."""
    stuck = prted(60)
    stopper = stop_a_stuck_runtime(stuck.pid, grace=0.2)
    assert stopper is not None
    assert stuck.wait(timeout=30) == 1      # the third SIGTERM
    assert stopper.wait(timeout=30) == 0


def test_a_runtime_that_ends_in_its_grace_is_left_alone_and_other_parents_too():
    ending = prted(0.5)
    stopper = stop_a_stuck_runtime(ending.pid, grace=20)
    assert ending.wait(timeout=30) == 0 and stopper.wait(timeout=30) == 0   # no SIGTERM: it ended by itself
    assert stop_a_stuck_runtime(os.getpid()) is None                        # pytest is no Open MPI runtime
