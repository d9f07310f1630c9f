"""One training step: its compute, what it reports, and the interface every synchronisation strategy has.

The engine's loop is the same for S-SGD and SMA: it fetches this rank's
batches (one per learner), asks the schedule where the step falls
(:class:`StepPlace`: the rate, the milestones passed, whether it ends the
epoch), and hands both to the strategy, which computes, synchronises and
updates on a cadence of its own (SMA: every ``sync_every`` steps, restarting
its learners at a milestone). A strategy is a small object with the methods
of :class:`Strategy`; ``dimd.train.sgd.SSGD`` and ``dimd.train.sma.SMA`` are
the two. Both compute every learner's gradients with :func:`forward_backward`,
and so does ``plan-batch step-time``, which times ``SSGD``'s step itself.

A strategy's step is written once, as bodies (functions of no argument) that read everything that
changes from step to step (the rate, SMA's alpha, the loss scale, the stop flag) from 0-d tensors on the
device, written by :class:`ScalarWrites`. The strategy runs each body through its *parts*: here
:class:`EagerParts` runs it as it is called; :class:`dimd.train.graphs.StepGraphs` captures it once
and replays it as a CUDA graph. So the arithmetic a graph replays is the arithmetic every CPU test runs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dimd.shuffle.device_feed import Batch

#: The time split of every epoch (``--metrics``, ``--json``), declared once: seconds per rank in
#: waiting for data, forward + backward, the allreduce, the optimizer / learner update, and
#: SMA's synchronisation arithmetic (corrections, central momentum, restarts).
TIME_SPLIT = ("data", "compute", "allreduce", "optimizer", "sync")


@dataclass
class StepTimes:
    """Seconds spent per phase, summed over steps."""

    data: float = 0.0
    compute: float = 0.0
    allreduce: float = 0.0
    optimizer: float = 0.0
    sync: float = 0.0

    def add(self, other: "StepTimes") -> None:
        for key in TIME_SPLIT:
            setattr(self, key, getattr(self, key) + getattr(other, key))

    def as_dict(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in TIME_SPLIT}


@dataclass(frozen=True)
class StepPlace:
    """Where a step falls in the run, by the engine's clock: what a strategy decides its cadence from."""

    lr: float              # the schedule's learning rate for this step
    step: int = 0          # steps taken before this one
    epoch: float = 0.0     # the step's place in the schedule, in epochs (a rank's batches / batches per epoch)
    phase: int = 0         # the schedule's milestones passed at that place (SMA restarts when it rises)
    last: bool = False     # the epoch's last step: what the learners hold is evaluated after it


@dataclass
class StepResult:
    """One step, as every rank sees it after the step's synchronisation (if it had one)."""

    loss_sum: float       # summed over every image every learner of every rank processed since the last sync
    correct: float
    samples: float
    stop: bool            # some rank asked to stop (a signal)
    times: StepTimes = field(default_factory=StepTimes)
    synced: bool = True   # False: learners stepped locally, the figures come with the next sync
    finite: bool = True   # loss and the synchronised update are finite (the same answer on every rank)
    events: list[str] = field(default_factory=list)   # things worth a log line (the auto-tuner's decisions)


Batches = Sequence[Batch]


class ScalarWrites:
    """The host's writes into the 0-d device tensors a step's bodies read, each made only when its value changed.

    A write is a fill kernel with the value as its argument: nothing in host memory for a later step to
    overwrite before a copy ran. :meth:`forget` makes the next write of every tensor happen (its tensor
    may have been replaced, or changed by a loaded checkpoint).
    """

    def __init__(self) -> None:
        self._last: dict[int, float] = {}   # id(tensor) -> the value last written into it

    def set(self, tensor: torch.Tensor, value: float) -> None:
        if self._last.get(id(tensor)) != value:
            tensor.fill_(value)
            self._last[id(tensor)] = value

    def forget(self) -> None:
        self._last.clear()


class StepParts(Protocol):
    """How a strategy runs its step's bodies: as called (:class:`EagerParts`) or as CUDA graphs
    (:class:`dimd.train.graphs.StepGraphs`)."""

    def begin_step(self) -> None: ...

    def run(self, part: str, key: Hashable, body: Callable[[], None], backend: Any = None,
            randoms: Sequence[Any] = ()) -> str: ...

    def reset(self, reason: str) -> None: ...

    def events(self) -> list[str]: ...


class EagerParts:
    """A step's bodies run as they are called, on the current stream (``backend`` and ``randoms`` are the
    graphs' own: the body itself draws from its random stream)."""

    def begin_step(self) -> None:
        return None

    def run(self, part: str, key: Hashable, body: Callable[[], None], backend: Any = None,
            randoms: Sequence[Any] = ()) -> str:
        body()
        return "eager"

    def reset(self, reason: str) -> None:
        return None

    def events(self) -> list[str]:
        return []


def _timing_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class PhaseClock:
    """A step's time split, taken without making the host wait for the device.

    On the CPU a phase ends when the host has done it (``perf_counter``). On a GPU the host only
    queues work, so the clock records a CUDA event where each phase ends and reads the events of a
    step once they are done, a step or so later (:meth:`collect`): the step keeps its one host wait,
    the read of its figures, and no other.
    """

    def __init__(self, device: torch.device, event: Callable[[], Any] | None = None) -> None:
        """``event``: makes a recorded CUDA event (tests: a stand-in with ``query`` and ``elapsed_time``)."""
        self.on_gpu = torch.device(device).type == "cuda" or event is not None
        self._event = event or _timing_event
        self._marks: list[tuple[str, Any]] = []
        self._waiting: list[list[tuple[str, Any]]] = []   # GPU: earlier steps' marks, read once done

    def _now(self) -> Any:
        return self._event() if self.on_gpu else time.perf_counter()

    def start(self) -> None:
        self._marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        """``phase`` (one of :data:`TIME_SPLIT`) ends now."""
        self._marks.append((phase, self._now()))

    def collect(self, times: StepTimes) -> StepTimes:
        """``times`` plus the phases of every step whose marks are done (on the CPU: this step's)."""
        self._waiting.append(self._marks)
        self._marks, waiting, self._waiting = [], self._waiting, []
        for marks in waiting:
            if self.on_gpu and not marks[-1][1].query():
                self._waiting.append(marks)   # not done yet: read at a later step
                continue
            for (_, begin), (phase, end) in zip(marks, marks[1:]):
                seconds = end - begin if not self.on_gpu else begin.elapsed_time(end) / 1000.0
                setattr(times, phase, getattr(times, phase) + seconds)
        return times


def forward_backward(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                     normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     precision: Any = None, label_smoothing: float = 0.0) -> torch.Tensor:
    """The compute of every training step (S-SGD's, each SMA learner's, the planner's timed one).

    Forward in training mode, the batch's mean cross-entropy (with ``label_smoothing``: the target
    puts ``1 - eps`` on the label and spreads ``eps`` over every class, as torch's loss does), backward:
    the gradients accumulate into each parameter's ``.grad`` (a flat buffer's view, so the caller
    zeroes it). Returns [loss summed over the images, images right at top-1] as a detached 2-vector
    on the device, without waiting for it.
    """
    model.train()
    x = normalize(images) if normalize is not None else images
    y = labels.to(x.device, non_blocking=True)
    # ``precision`` (dimd.train.precision.Precision): autocast over forward and loss, 16-mixed's scaled backward
    with precision.autocast() if precision is not None else contextlib.nullcontext():
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=label_smoothing)
    if precision is not None:
        precision.backward(loss)
    else:
        loss.backward()
    with torch.no_grad():
        return torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum().float()])


class Strategy(Protocol):
    """The per-step synchronisation: S-SGD's gradient allreduce or SMA's model averaging."""

    name: str                      # "ssgd" or "sma", as ``--sync`` names it
    average: Any                   # the weights' moving average (dimd.train.ema.WeightAverage), or None

    @property
    def learners(self) -> int:
        """Batches this rank consumes per step (one per learner)."""

    def step(self, batches: Batches, place: StepPlace, *, stop: bool = False,
             times: StepTimes | None = None) -> StepResult:
        """Compute, synchronise when the strategy's cadence says so (collective then: every rank
        decides alike from ``place``), update. ``times`` arrives with the step's wait for data
        filled in; the result's times add the strategy's phases."""

    def eval_model(self) -> nn.Module:
        """Collective: the model to evaluate and checkpoint (the replica, or z with averaged batch-norm statistics)."""

    def global_state(self) -> dict[str, Any]:
        """What every rank holds alike (optimizer momentum, z's momentum, the tuner)."""

    def local_state(self) -> dict[str, Any]:
        """What only this rank holds (batch-norm statistics, its learners)."""

    def load_state(self, shared: dict[str, Any], local: dict[str, Any] | None) -> list[str]:
        """Continue from a checkpoint; ``local`` None: another layout (start the local part afresh).

        Returns what it had to change, as log lines.
        """

    def figures(self) -> dict[str, Any]:
        """Strategy-specific ``--json`` figures."""

    def identical(self, comm: Any) -> bool:
        """Collective: whether every rank holds bit-identical model weights."""

    def close(self) -> None:
        ...
