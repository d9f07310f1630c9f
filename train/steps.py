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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

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


Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def forward_backward(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                     normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     precision: Any = None) -> torch.Tensor:
    """The compute of every training step (S-SGD's, each SMA learner's, the planner's timed one).

    Forward in training mode, the batch's mean cross-entropy, backward: the
    gradients accumulate into each parameter's ``.grad`` (a flat buffer's
    view, so the caller zeroes it). Returns [loss summed over the images,
    images right at top-1] as a detached 2-vector on the device, without
    waiting for it.
    """
    model.train()
    x = normalize(images) if normalize is not None else images
    y = labels.to(x.device, non_blocking=True)
    # ``precision`` (dimd.train.precision.Precision): autocast over forward and loss, 16-mixed's scaled backward
    with precision.autocast() if precision is not None else contextlib.nullcontext():
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    if precision is not None:
        precision.backward(loss)
    else:
        loss.backward()
    with torch.no_grad():
        return torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum().float()])


class Strategy(Protocol):
    """The per-step synchronisation: S-SGD's gradient allreduce or SMA's model averaging."""

    name: str                      # "ssgd" or "sma", as ``--sync`` names it

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
