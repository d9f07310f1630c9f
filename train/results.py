"""What a training run reports: one record per epoch (``--metrics``), per evaluation, and the whole run (``--json``).

Plain records, filled in by the engine (:mod:`dimd.train.engine`) and saved in
checkpoints (:mod:`dimd.train.checkpoint`) as dicts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dimd.train.config import TrainConfig
from dimd.train.steps import TIME_SPLIT, StepResult, StepTimes


@dataclass
class EpochMetrics:
    """One line of ``--metrics``: the epoch's training and validation figures and time split."""

    epoch: int                    # 1-based: epochs finished
    step: int                     # steps taken so far (S-SGD: optimizer steps; SMA: learner steps)
    lr: float
    train_loss: float
    train_top1: float
    val_loss: float
    val_top1: float
    val_top5: float
    images: int                   # training images processed this epoch (all ranks)
    images_per_s: float           # training throughput (all ranks), excluding evaluation
    seconds: float                # the whole epoch: shuffle + train + evaluation
    train_seconds: float
    eval_seconds: float
    shuffle_seconds: float
    time_split: dict[str, float]  # per-rank seconds, averaged over ranks (TIME_SPLIT)
    elapsed: float = 0.0          # seconds since the run started (before the data was loaded)
    sync: str = "ssgd"
    learners_per_rank: int = 1    # at the epoch's end (the auto-tuner changes it)
    alpha: float | None = None    # SMA's correction weight at the epoch's end
    synchronisations: int = 0     # this epoch's (S-SGD: one per step)
    # ``noise_scale``: the gradient noise scale B_simple at the epoch's end (an EMA over steps), with
    # the averages of |G|^2 and tr(Sigma) it is the ratio of; None when not estimated (then not written).
    noise_scale: float | None = None
    noise_gradient_sqnorm: float | None = None
    noise_trace: float | None = None
    noise_steps: int | None = None
    # ``ema``: the weights' moving average's validation figures, beside the model's; None when off (not written).
    ema_val_loss: float | None = None
    ema_val_top1: float | None = None
    ema_val_top5: float | None = None
    # ``target_top1``: set on the epoch that reached it: the target, the top-1 reached, by which model, and
    # the run's seconds, train_seconds, epochs, updates and images then (as MLPerf reports a time to train).
    target: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        values = dict(self.__dict__)
        if self.noise_steps is None:   # not asked for: the metrics lines stay as they were
            for key in NOISE_FIELDS:
                del values[key]
        for key in OPTIONAL_FIELDS:
            if values[key] is None:
                del values[key]
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EpochMetrics":
        known = {f.name for f in fields(cls)}
        metrics = cls(**{k: v for k, v in values.items() if k in known})
        metrics.time_split = {key: float(metrics.time_split.get(key, 0.0)) for key in TIME_SPLIT}
        return metrics


NOISE_FIELDS = ("noise_scale", "noise_gradient_sqnorm", "noise_trace", "noise_steps")
#: Fields an epoch's record leaves out where they are None (``ema`` off, the target not reached at it).
OPTIONAL_FIELDS = ("ema_val_loss", "ema_val_top1", "ema_val_top5", "target")


@dataclass
class EpochTally:
    """This epoch so far, on this rank: what the steps reported and where the time went."""

    loss_sum: float = 0.0         # over all ranks (the step results are global)
    correct: float = 0.0
    samples: float = 0.0
    train_seconds: float = 0.0
    shuffle_seconds: float = 0.0
    synchronisations: int = 0
    times: StepTimes = field(default_factory=StepTimes)

    def add(self, result: StepResult, seconds: float) -> None:
        self.loss_sum += result.loss_sum
        self.correct += result.correct
        self.samples += result.samples
        self.synchronisations += int(result.synced)
        self.train_seconds += seconds
        self.times.add(result.times)

    def as_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items() if k != "times"}, "times": self.times.as_dict()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EpochTally":
        times = StepTimes(**{k: float(v) for k, v in values.get("times", {}).items() if k in TIME_SPLIT})
        return cls(**{k: v for k, v in values.items() if k != "times"}, times=times)


@dataclass
class Evaluation:
    """One evaluation of the model, where in the run it happened."""

    epoch: float                  # epochs of training done (fractional between epoch ends)
    images: int                   # training images processed so far (all ranks)
    elapsed: float                # seconds since the run started
    top1: float
    top5: float
    loss: float
    step: int = 0                 # steps taken so far (S-SGD: updates)
    train_seconds: float = 0.0    # seconds in training steps so far (this rank's; no loading, evaluation, shuffles)
    ema_top1: float | None = None  # the weights' moving average's, where there is one (``ema``)
    ema_top5: float | None = None
    ema_loss: float | None = None


@dataclass
class TrainResult:
    """The whole run, as ``dimd train --json`` reports it (:meth:`figures`)."""

    config: TrainConfig
    model: dict[str, Any]
    world_size: int
    device: str
    allreduce: str
    allreduce_choice: dict[str, Any]
    steps_per_epoch: int
    global_batch: int                   # images per step, all ranks (SMA: all learners)
    lr_batch: int                       # the batch --lr was scaled by
    schedule: dict[str, Any]
    sync: str = "ssgd"
    strategy: dict[str, Any] = field(default_factory=dict)
    epochs: list[EpochMetrics] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    resumed_from: str | None = None
    stopped_by: str | None = None       # the signal (or "target") that ended the run early
    checkpoint: str | None = None       # the last checkpoint written
    replicas_identical: bool | None = None
    seconds: float = 0.0
    threads: int = 0                    # torch compute threads per rank
    decode_workers: int = 0             # the loader's decoding processes per rank
    run_id: str | None = None           # the run's id, as its checkpoints record it
    memory: list[dict[str, int]] = field(default_factory=list)   # per rank, at the last epoch's end
    target: dict[str, Any] | None = None   # ``target_top1``: whether and where the run reached it

    @property
    def final(self) -> EpochMetrics | None:
        return self.epochs[-1] if self.epochs else None

    def figures(self) -> dict[str, Any]:
        """The ``--json`` figures (the CLI wraps them in the standard envelope)."""
        run = self.epochs
        images = sum(e.images for e in run)
        train_s = sum(e.train_seconds for e in run)
        split = {k: sum(e.time_split.get(k, 0.0) for e in run) for k in TIME_SPLIT}
        final = self.final
        return {
            "model": self.model, "world_size": self.world_size, "device": self.device,
            "sync": self.sync, **self.strategy,
            "learners_per_rank": [e.learners_per_rank for e in run],
            "synchronisations": sum(e.synchronisations for e in run),
            "allreduce": self.allreduce, "allreduce_choice": self.allreduce_choice,
            "steps_per_epoch": self.steps_per_epoch, "global_batch": self.global_batch,
            "lr_batch": self.lr_batch, "schedule": self.schedule, "resumed_from": self.resumed_from,
            "stopped_by": self.stopped_by, "target": self.target,
            "checkpoint": self.checkpoint, "replicas_identical": self.replicas_identical,
            "seconds": self.seconds, "threads": self.threads,
            "decode_workers": self.decode_workers, "run_id": self.run_id, "epochs_run": len(run),
            "memory_per_rank": self.memory,
            "images_per_s": images / train_s if train_s > 0 else 0.0,
            "time_split": split,
            "final": final.as_dict() if final else None,
            "val_top1": final.val_top1 if final else None,
            "val_top5": final.val_top5 if final else None,
            "history": [e.as_dict() for e in self.epochs],
            "evaluations": [e.__dict__ for e in self.evaluations],
        }


def metrics_line(metrics: EpochMetrics, run_id: str) -> str:
    """One ``--metrics`` line: the epoch's figures and the run they belong to (its checkpoints' id)."""
    return json.dumps({"run_id": run_id, **metrics.as_dict()}) + "\n"


def drop_superseded_metrics(path: str | os.PathLike, run_id: str, epochs_done: int) -> int:
    """Before a resumed run appends to ``path``: remove its own lines for the epochs it will run again.

    A run resumed from an earlier checkpoint than its last line (a crash after
    epoch 5, the newest checkpoint after epoch 3) would otherwise append
    epochs 4 and 5 a second time. Other runs' lines, and anything that is not
    a metrics line, stay. Returns how many lines went.
    """
    from dimd.fsutil import atomic_write_text

    try:
        lines = Path(path).read_text(encoding="utf-8", errors="surrogateescape").splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = [line for line in lines if not _superseded(line, run_id, epochs_done)]
    if len(kept) < len(lines):
        atomic_write_text(path, "".join(kept))
    return len(lines) - len(kept)


def _superseded(line: str, run_id: str, epochs_done: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return (isinstance(record, dict) and record.get("run_id") == run_id
            and isinstance(record.get("epoch"), int) and record["epoch"] > epochs_done)
