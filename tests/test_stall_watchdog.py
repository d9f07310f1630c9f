"""The stall watchdog notices a wait for the other ranks that outlasts its timeout (dimd.stall).

The whole job it ends is tested on real ranks (test_mpi_setup.py) and across two hosts, one of them
cut off (tests/multihost/); here its clock is a counter the test moves by hand, and a real 2-rank
training run shows that each of its waits for the other ranks is one the watchdog sees.
"""

import json
import threading

import pytest
from conftest import mpi_run

from dimd.allreduce.bench import BenchConfig
from dimd.errors import DimdError
from dimd.shuffle.rounds import ShuffleConfig
from dimd.stall import StallWatchdog
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


@pytest.mark.mpi
def test_every_wait_of_a_training_run_is_watched(colour_set):
    """A collective outside the marked waits is where a lost peer would hang the job past any timeout."""
    proc = mpi_run("every_wait_of_training_is_watched", 2, str(colour_set), timeout=240, check=True)
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {(run["run"], run["rank"]) for run in runs} == {(s, r) for s in ("ssgd", "sma") for r in (0, 1)}
    assert all(run["calls"] > 0 and run["unwatched"] == [] for run in runs), runs


@pytest.mark.mpi
def test_every_wait_of_the_other_mpi_commands_after_their_load_is_watched(colour_set):
    """The load's reads may lag each other by any time, so its waits are not watched; everything after is."""
    proc = mpi_run("every_wait_of_the_other_mpi_commands_is_watched", 2, str(colour_set), timeout=120, check=True)
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    commands = ("shuffle", "bench-allreduce", "plan-batch step-time")
    assert {(run["run"], run["rank"]) for run in runs} == {(c, r) for c in commands for r in (0, 1)}
    assert all(run["calls"] > 0 and run["unwatched"] == [] for run in runs), runs
