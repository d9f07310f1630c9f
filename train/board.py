"""``dimd train --tensorboard DIR``: the run's scalars as TensorBoard event files, written by rank 0.

Fed by the hooks the trainer calls (:class:`dimd.train.engine.Hooks`), so the library stays silent:

- every ``every`` steps, from the epoch's tally (:class:`dimd.train.results.EpochTally`) since the last
  write: ``train/loss``, ``train/top1``, ``train/lr``, ``train/images_per_s`` and the step's split in seconds
  per step (``step_time/data``, ``compute``, ``allreduce``, ``optimizer``, and ``sync`` under SMA);
- every epoch, from its record (:class:`dimd.train.results.EpochMetrics`): ``val/loss``, ``val/top1``,
  ``val/top5``, ``epoch/train_loss``, ``epoch/train_top1``, ``epoch/images_per_s``;
- under SMA: ``sma/learners_per_rank``, ``sma/alpha`` and ``sma/synchronisations`` per epoch.

The x axis is the step count (``trainer.state.step``). tensorboard is an optional extra: without it the
flag is refused in one line, on every rank, before the data loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

#: Why ``--tensorboard`` cannot run here, when the package is missing.
MISSING = ("--tensorboard needs the tensorboard extra: `make tensorboard-setup` installs tensorboard without "
           "the plain Pillow it asks for, and dimd[tensorboard] its other dependencies")


def tensorboard_problem() -> str | None:
    """Why TensorBoard files cannot be written here (one line), or None."""
    return MISSING if importlib.util.find_spec("tensorboard") is None else None


class TrainingBoard:
    """A run's TensorBoard writer (rank 0's; the other ranks' writes nothing): :meth:`hooks` wraps the
    caller's hooks, so the board hears what they hear."""

    def __init__(self, folder: Path | None, every: int) -> None:
        self.every = every
        self.writer: Any = None
        if folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(folder))
        self.trainer: Any = None
        self._tally: Any = None                 # the epoch's tally (the trainer starts a new one each epoch)
        self._seen: dict[str, float] = {}       # its sums at the last write
        self._steps = 0                         # steps since then

    def hooks(self, inner: Any) -> Any:
        """``inner`` (a :class:`Hooks`) with this board called after each of its hooks."""
        from dimd.train.engine import Hooks

        def on_start(trainer: Any) -> None:
            inner.on_start(trainer)
            self.trainer = trainer

        def on_step(steps: int) -> None:
            inner.on_step(steps)
            self.step()

        def on_epoch(metrics: Any) -> None:
            inner.on_epoch(metrics)
            self.epoch(metrics)

        return Hooks(on_start=on_start, on_step=on_step, on_epoch=on_epoch, on_event=inner.on_event)

    def step(self) -> None:
        """After a step: every ``every`` steps, the figures of the steps since the last write (this epoch's)."""
        from dimd.train.steps import TIME_SPLIT

        trainer = self.trainer
        if self.writer is None or trainer is None:
            return
        state, tally = trainer.state, trainer.state.tally
        if tally is not self._tally:   # a new epoch: its tally counts from zero
            self._tally, self._seen, self._steps = tally, {}, 0
        self._steps += 1
        if state.step % self.every:
            return
        now = {"loss": tally.loss_sum, "correct": tally.correct, "samples": tally.samples,
               "seconds": tally.train_seconds, **tally.times.as_dict()}
        delta = {k: v - self._seen.get(k, 0.0) for k, v in now.items()}
        steps, self._seen, self._steps = self._steps, now, 0
        if delta["samples"] <= 0:
            return
        write = self.writer.add_scalar
        write("train/loss", delta["loss"] / delta["samples"], state.step)
        write("train/top1", delta["correct"] / delta["samples"], state.step)
        if delta["seconds"] > 0:
            write("train/images_per_s", delta["samples"] / delta["seconds"], state.step)
        epoch, done = trainer.loader.position   # the schedule counts a rank's batches
        write("train/lr", trainer.schedule.lr(epoch * trainer.batches_per_epoch + done), state.step)
        for part in TIME_SPLIT:
            if part != "sync" or trainer.config.sync == "sma":
                write(f"step_time/{part}", delta[part] / steps, state.step)

    def epoch(self, metrics: Any) -> None:
        """After an epoch: its validation and training figures (and SMA's), at the step it ended."""
        if self.writer is None:
            return
        write, step = self.writer.add_scalar, metrics.step
        for name, value in (("val/loss", metrics.val_loss), ("val/top1", metrics.val_top1),
                            ("val/top5", metrics.val_top5), ("epoch/train_loss", metrics.train_loss),
                            ("epoch/train_top1", metrics.train_top1), ("epoch/images_per_s", metrics.images_per_s)):
            write(name, value, step)
        if metrics.sync == "sma":
            write("sma/learners_per_rank", metrics.learners_per_rank, step)
            write("sma/synchronisations", metrics.synchronisations, step)
            if metrics.alpha is not None:
                write("sma/alpha", metrics.alpha, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
