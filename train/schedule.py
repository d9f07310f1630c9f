"""Learning-rate rules as pure functions of the step: linear scaling, warm-up, step, poly, cosine.

* Linear scaling (Krizhevsky; Goyal et al.): ``--lr`` is given for a global
  batch of 256 and multiplied by ``global_batch / 256``.
* Gradual warm-up (Goyal et al., followed by the DIMD paper, section 5): the
  rate rises linearly, step by step, from the unscaled rate to the scaled one
  over the first warm-up epochs (from a tenth of it when the global batch is
  at most 256, where scaling does not raise it).
* ``step``: divided by 10 at given epochs (default 30/60/80 of 90, scaled to
  the run's length); ``poly``: ``lr * (1 - t)^power`` with power 0.5 as
  FireCaffe trained GoogLeNet; ``cosine``: ``lr * (1 + cos(pi t)) / 2``;
  where ``t`` runs from 0 at the end of the warm-up to 1 at the last step.

Every value depends only on the step number, so a resumed run continues the
schedule exactly from its checkpointed step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

ScheduleKind = Literal["step", "poly", "cosine", "constant"]
SCHEDULES: tuple[str, ...] = ("step", "poly", "cosine", "constant")
REFERENCE_BATCH = 256
#: The ResNet recipe's milestones (30, 60, 80 of 90 epochs), as fractions of the run.
STEP_FRACTIONS = (30 / 90, 60 / 90, 80 / 90)


def scaled_lr(lr: float, global_batch: int, *, scaling: bool = True,
              reference_batch: int = REFERENCE_BATCH) -> float:
    """The linear scaling rule: ``lr`` is for ``reference_batch`` images per step."""
    return lr * global_batch / reference_batch if scaling else lr


def default_warmup_epochs(global_batch: int, *, reference_batch: int = REFERENCE_BATCH) -> float:
    """Goyal et al.: 5 warm-up epochs when the global batch exceeds the reference, else none."""
    return 5.0 if global_batch > reference_batch else 0.0


def default_milestones(epochs: int) -> tuple[int, ...]:
    """30/60/80 of 90 epochs, scaled to ``epochs`` (distinct, inside the run)."""
    marks = sorted({max(1, round(epochs * f)) for f in STEP_FRACTIONS})
    return tuple(m for m in marks if m < epochs) if epochs > 1 else ()


def warmup_lr(step: int, warmup_steps: int, start_lr: float, target_lr: float) -> float:
    """Linear ramp from ``start_lr`` at step 0 to ``target_lr`` at ``warmup_steps``."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return target_lr
    return start_lr + (target_lr - start_lr) * step / warmup_steps


def step_lr(lr: float, epoch: float, milestones: Sequence[float], gamma: float = 0.1) -> float:
    """``lr`` times ``gamma`` for every milestone (in epochs) already reached."""
    return lr * gamma ** sum(1 for m in milestones if epoch >= m)


def poly_lr(lr: float, progress: float, power: float = 0.5) -> float:
    """FireCaffe/Caffe ``poly``: ``lr * (1 - progress)^power``, progress in [0, 1]."""
    return lr * (1.0 - min(max(progress, 0.0), 1.0)) ** power


def cosine_lr(lr: float, progress: float) -> float:
    """Half a cosine from ``lr`` to 0 as progress goes from 0 to 1."""
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


@dataclass(frozen=True)
class Schedule:
    """A whole run's learning-rate rule; :meth:`lr` is a pure function of the step."""

    kind: ScheduleKind
    peak_lr: float                 # after linear scaling
    steps_per_epoch: int
    epochs: int
    warmup_epochs: float = 0.0
    warmup_start_lr: float | None = None   # default: the unscaled rate (or the peak, if lower)
    milestones: tuple[float, ...] = ()     # epochs, for kind="step"
    gamma: float = 0.1
    power: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.kind!r}; choose from {', '.join(SCHEDULES)}")
        if self.steps_per_epoch < 1 or self.epochs < 1:
            raise ValueError("a schedule needs at least one epoch of at least one step")

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def warmup_steps(self) -> int:
        return min(round(self.warmup_epochs * self.steps_per_epoch), self.total_steps)

    def phase(self, step: int) -> int:
        """How many milestones of a step schedule lie at or before ``step`` (SMA restarts at each)."""
        if self.kind != "step":
            return 0
        return sum(1 for m in self.milestones if step >= m * self.steps_per_epoch)

    def lr(self, step: int) -> float:
        """The rate for optimizer step ``step`` (0-based, counted over the whole run)."""
        warm = self.warmup_steps
        if step < warm:
            start = self.peak_lr if self.warmup_start_lr is None else self.warmup_start_lr
            return warmup_lr(step, warm, start, self.peak_lr)
        if self.kind == "constant":
            return self.peak_lr
        if self.kind == "step":
            return step_lr(self.peak_lr, step / self.steps_per_epoch, self.milestones, self.gamma)
        progress = (step - warm) / max(self.total_steps - warm, 1)
        if self.kind == "poly":
            return poly_lr(self.peak_lr, progress, self.power)
        return cosine_lr(self.peak_lr, progress)


def warmup_start(lr: float, peak: float) -> float:
    """Goyal et al. ramp up from the unscaled rate; when scaling did not raise it (a global
    batch of at most 256), the ramp starts from a tenth of the peak instead."""
    return lr if lr < peak else 0.1 * peak


def make_schedule(kind: ScheduleKind, lr: float, *, global_batch: int, steps_per_epoch: int,
                  epochs: int, scaling: bool = True, warmup_epochs: float | None = None,
                  milestones: Sequence[float] | None = None, gamma: float = 0.1,
                  power: float = 0.5) -> Schedule:
    """Build a :class:`Schedule` with the recipe's defaults for whatever is left as ``None``."""
    peak = scaled_lr(lr, global_batch, scaling=scaling)
    if warmup_epochs is None:
        warmup_epochs = default_warmup_epochs(global_batch)
    if milestones is None:
        milestones = default_milestones(epochs)
    return Schedule(kind=kind, peak_lr=peak, steps_per_epoch=steps_per_epoch, epochs=epochs,
                    warmup_epochs=float(warmup_epochs), warmup_start_lr=warmup_start(lr, peak),
                    milestones=tuple(float(m) for m in milestones), gamma=gamma, power=power)
