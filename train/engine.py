"""The training engine: S-SGD (DIMD paper, sections 3 and 5) and SMA (Crossbow, section 3) in one loop.

Collective over ``comm``: every rank loads its share of the packed training
and validation sets into memory (:class:`dimd.shuffle.DistributedStore`) and
builds the same model (rank 0's weights broadcast). Then each step

1. takes this rank's next batches from the loader, one per learner,
2. asks the schedule for the learning rate (restarting SMA's learners at a
   milestone of the step schedule),
3. hands both to the synchronisation strategy: S-SGD's gradient allreduce
   (:class:`dimd.train.sgd.SSGD`) or SMA's model averaging
   (:class:`dimd.train.sma.SMA`),
4. adds the step to the epoch's tally, checkpoints or reshuffles if due.

At an epoch's end: evaluate (the replica, or SMA's central model z), record
the epoch, checkpoint. Rank 0 writes checkpoints; a SIGTERM/SIGUSR1 ends the
run cleanly after a checkpoint. The library never prints: progress goes to
callbacks. Lines that exist only because the program is distributed carry a
``# MPI:`` comment.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Generator

import numpy as np
import torch

from dimd.errors import DimdError
from dimd.train.checkpoint import (checkpoint_step, latest_checkpoint, list_checkpoints, load_checkpoint,
                                  save_checkpoint)
from dimd.train.config import TrainConfig
from dimd.train.evaluate import EvalResult, local_counts, summarize
from dimd.train.models import MODELS, build_model, gradient_bytes, parameter_count
from dimd.train.schedule import Schedule, make_schedule
from dimd.train.signals import StopRequest, stop_request
from dimd.train.steps import TIME_SPLIT, StepResult, StepTimes, Strategy


class TrainingDiverged(DimdError):
    """The loss or the synchronised update stopped being finite (every rank raises it at the same step)."""


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

    def as_dict(self) -> dict[str, Any]:
        values = dict(self.__dict__)
        if self.noise_steps is None:   # not asked for: the metrics lines stay as they were
            for key in NOISE_FIELDS:
                del values[key]
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EpochMetrics":
        known = {f.name for f in fields(cls)}
        metrics = cls(**{k: v for k, v in values.items() if k in known})
        metrics.time_split = {key: float(metrics.time_split.get(key, 0.0)) for key in TIME_SPLIT}
        return metrics


NOISE_FIELDS = ("noise_scale", "noise_gradient_sqnorm", "noise_trace", "noise_steps")


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


@dataclass
class TrainResult:
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
            "stopped_by": self.stopped_by,
            "checkpoint": self.checkpoint, "replicas_identical": self.replicas_identical,
            "seconds": self.seconds, "epochs_run": len(run),
            "images_per_s": images / train_s if train_s > 0 else 0.0,
            "time_split": split,
            "final": final.as_dict() if final else None,
            "val_top1": final.val_top1 if final else None,
            "val_top5": final.val_top5 if final else None,
            "history": [e.as_dict() for e in self.epochs],
            "evaluations": [e.__dict__ for e in self.evaluations],
        }


Callback = Callable[..., None]


def default_threads(comm: Any) -> int:
    """Torch threads per rank by default: the node's cores shared by its ranks (MPI: node-local ranks)."""
    from dimd.host import available_cores
    from dimd.mpi import node_local_ranks

    return max(1, available_cores() // node_local_ranks(comm))


def set_threads(threads: int | None, comm: Any) -> int:
    """Torch threads as ``dimd train`` sets them: ``threads``, else :func:`default_threads`
    (left alone when OMP_NUM_THREADS is set and ``threads`` is not); returns the count in force."""
    if threads or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads or default_threads(comm))
    return torch.get_num_threads()


def pick_device(choice: str, comm) -> torch.device:
    """``auto``: CUDA when present (one GPU per rank on a node, by node-local rank), else CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DimdError("device cuda: this torch build or machine has no CUDA device")
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)   # MPI: one GPU per rank of this node
    index = local.Get_rank() % torch.cuda.device_count()
    local.Free()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def choose_allreduce(config: TrainConfig, nbytes: int, comm) -> tuple[str, dict[str, Any]]:
    """The requested algorithm, or the fastest measured now for this message size."""
    if config.allreduce is not None:  # TrainConfig checked the name
        return config.allreduce, {"how": "requested"}
    if comm.Get_size() == 1:
        return "mpi", {"how": "single rank"}
    from dimd.allreduce import choose_fastest

    return choose_fastest(nbytes, comm, np.float32), {"how": "fastest measured at start-up",
                                                       "bytes": nbytes}


def val_label_map(train_classes: list[str], val_classes: list[str], val: str,
                  train: str) -> torch.Tensor | None:
    """Val label -> train label, by class name (a val set packed from a list may order them otherwise)."""
    if list(val_classes) == list(train_classes):
        return None
    index = {name: i for i, name in enumerate(train_classes)}
    unknown = [name for name in val_classes if name not in index]
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise DimdError(f"{val}: {len(unknown)} of its {len(val_classes)} classes are not classes of "
                        f"{train} ({shown}); is it the validation set of this training set?")
    return torch.tensor([index[name] for name in val_classes], dtype=torch.int64)


def learner_compute(choice: str) -> str:
    """``auto``: one replica after another, on CUDA each on its own stream (Crossbow's way); on a
    CPU core measured faster than one vectorised vmap pass at 1-4 learners (docs/sma.md)."""
    return "loop" if choice == "auto" else choice


def make_reducer(algorithm: str, comm) -> Callable[[np.ndarray], None]:
    from dimd.allreduce import allreduce

    def reduce(array: np.ndarray) -> None:
        allreduce(array, comm, algorithm)   # MPI: sum over the ranks

    return reduce


class Trainer:
    """One training run: the constructor sets it up (collective over ``comm``), :meth:`run` trains.

    ``eval_every_images`` adds an evaluation whenever that many more training
    images (all ranks) have been processed; ``target_top1`` ends the run
    (``stopped_by == "target"``) at the first evaluation that reaches it.
    ``device`` overrides ``config.device`` (``plan-batch convergence`` picks
    each rank's GPU on the whole job, then trains on a sub-communicator).
    """

    def __init__(self, config: TrainConfig, comm, *, stop: StopRequest | None = None,
                 on_epoch: Callback | None = None, on_step: Callback | None = None,
                 on_event: Callback | None = None, on_start: Callback | None = None,
                 eval_every_images: int | None = None, target_top1: float | None = None,
                 device: torch.device | None = None) -> None:
        from dimd.shuffle import BatchLoader, DistributedStore

        self.started = time.perf_counter()
        self.config = cfg = config
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        if cfg.noise_scale and self.world < 2:   # before the data loads
            raise DimdError("`noise_scale` needs at least 2 ranks: it compares each rank's gradient with their "
                            "average (run under mpirun -n 2 or more)")
        #: The stop signals' flag; the caller enters it (before this set-up, so that a signal during
        #: loading is not lost) or :meth:`run` takes the process-wide one (``stop_request``).
        self.stop = stop if stop is not None else StopRequest()
        self._own_stop = stop is None
        self.on_epoch = on_epoch or (lambda metrics: None)
        self.on_step = on_step or (lambda n: None)
        self.on_event = on_event or (lambda message: None)
        self.on_start = on_start or (lambda trainer: None)
        self.eval_every_images = eval_every_images
        self.target_top1 = target_top1

        # -- hardware and data
        if cfg.model not in MODELS:
            build_model(cfg.model, 1)  # raises the clear "unknown model" error
        set_threads(cfg.threads, comm)   # MPI: the node's cores are shared by its ranks
        # ``device``: chosen by a caller whose ``comm`` is a part of the job (a rank's place on its node is not)
        self.device = device if device is not None else pick_device(cfg.device, comm)
        if cfg.decode == "gpu":
            from dimd.shuffle.gpu_decode import gpu_decode_problem

            problem = gpu_decode_problem() if self.device.type == "cuda" else "decode gpu needs `device` cuda"
            if problem:
                raise DimdError(problem)
        t0 = time.perf_counter()
        self.store = DistributedStore.load(cfg.train, comm, groups=cfg.groups, memory_limit=cfg.memory_limit)
        self.val_store = DistributedStore.load(cfg.val, comm, groups=1, memory_limit=cfg.memory_limit)
        self.val_label_map = val_label_map(self.store.classes, self.val_store.classes, cfg.val, cfg.train)
        self.on_event(f"loaded {self.store.total} training and {self.val_store.total} validation records "
                      f"into memory in {time.perf_counter() - t0:.1f}s")
        pin = self.device.type == "cuda"
        source: Any = self.store
        if cfg.read_from != "memory":
            from dimd.train.filesource import OriginalFiles

            source = OriginalFiles(self.store, cfg.files_root, cold=cfg.read_from == "files-cold")
        from dimd.train.device_feed import device_feed

        # The batches reach the device one step ahead, on a copy stream (decoded there with decode gpu).
        self.loader = device_feed(BatchLoader(source, cfg.batch_size, cfg.image_size, train=True,
                                              workers=cfg.decode_threads, seed=cfg.seed, pin_memory=pin,
                                              crop_scale=cfg.crop_scale), self.device, cfg.decode)
        self.val_loader = device_feed(BatchLoader(self.val_store, cfg.eval_batch_size or cfg.batch_size,
                                                  cfg.image_size, train=False, workers=cfg.decode_threads,
                                                  seed=cfg.seed, pin_memory=pin), self.device, cfg.decode)
        #: Batches of ``batch_size`` per rank per epoch; the schedule counts these, so its
        #: position is the same whatever the learners per rank.
        self.batches_per_epoch = self.loader.steps_per_epoch

        # -- model, synchronisation, schedule
        torch.manual_seed(cfg.seed)
        from dimd.train.precision import Precision, memory_format

        self.model = build_model(cfg.model, len(self.store.classes), zero_init_residual=cfg.zero_init_residual)
        self.memory_format = memory_format(cfg.channels_last if cfg.sync == "ssgd" else False, self.device,
                                           self.model)
        self.model.to(self.device, memory_format=self.memory_format)
        self.precision = Precision(cfg.precision, self.device)
        from dimd.train.sgd import Normalize, broadcast_state

        broadcast_state(self.model, comm)   # MPI: every rank starts from rank 0's weights
        self.normalize = Normalize(self.device, self.memory_format)
        nbytes = gradient_bytes(self.model)
        self.model_info = {"name": cfg.model, "parameters": parameter_count(self.model),
                           "gradient_bytes": nbytes, "classes": len(self.store.classes)}
        # MPI: the allreduce algorithm, measured for this message size if not given
        self.algorithm, self.algorithm_choice = choose_allreduce(cfg, nbytes, comm)
        self.strategy: Strategy = self.make_strategy()
        #: The batch ``--lr`` is scaled by (linear scaling, lr x batch / 256): S-SGD's global batch
        #: per step; under SMA a learner's own batch, since every learner steps on its own.
        self.lr_batch = cfg.batch_size * self.world if cfg.sync == "ssgd" else cfg.batch_size
        self.schedule: Schedule = make_schedule(
            cfg.schedule, cfg.lr, global_batch=self.lr_batch,  # type: ignore[arg-type]  # TrainConfig checked it
            steps_per_epoch=self.batches_per_epoch, epochs=cfg.epochs, scaling=cfg.lr_scaling,
            warmup_epochs=cfg.warmup_epochs, milestones=cfg.milestones, power=cfg.power)

        # -- where the run stands (a checkpoint restores all of it)
        self.epoch = 0                 # epochs finished
        self.step = 0                  # steps taken (each consumes one batch per learner)
        self.since_sync = 0            # SMA: learner steps since the last synchronisation
        self.lr_phase = 0              # milestones passed when the last step ran (SMA restarts)
        self.images = 0                # training images processed, all ranks
        self.train_seconds = 0.0       # in training steps so far (this rank's clock)
        self.next_eval_images = eval_every_images or 0
        self.tally = EpochTally()
        self.history: list[EpochMetrics] = []
        self.evaluations: list[Evaluation] = []
        self.stopped_by: str | None = None
        self.resumed_from: str | None = None
        self.last_checkpoint: str | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Steps in an epoch: one per batch under S-SGD, one per K batches (one each) under SMA."""
        return self.batches_per_epoch // self.strategy.learners

    @property
    def global_batch(self) -> int:
        """Images per step over all ranks (and all learners)."""
        return self.config.batch_size * self.world * self.strategy.learners

    def make_strategy(self) -> Strategy:
        cfg = self.config
        reduce = make_reducer(self.algorithm, self.comm)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        if cfg.sync == "sma":
            from dimd.train.sma import SMA

            return SMA(self.model, reduce, self.world, learners=None if cfg.autotune else int(cfg.learners or 1),
                       alpha=cfg.alpha, momentum=cfg.momentum, central_momentum=cfg.sma_momentum,
                       weight_decay=cfg.weight_decay, decay_bn_and_bias=cfg.decay_bn_and_bias,
                       compute=learner_compute(cfg.learner_compute),
                       normalize=self.normalize, threads=torch.get_num_threads(),
                       autotune_threshold=cfg.autotune_threshold,
                       max_learners=self.batches_per_epoch, synchronize=sync)
        from dimd.train.sgd import SSGD, SyncSGD, make_optimizer

        optimizer = make_optimizer(self.model, lr=cfg.lr, momentum=cfg.momentum,
                                   weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
                                   decay_bn_and_bias=cfg.decay_bn_and_bias)
        noise = None
        if cfg.noise_scale:
            from dimd.train.plan.noise import NoiseScale

            noise = NoiseScale()
        return SSGD(SyncSGD(self.model, optimizer, reduce, self.world, bucket_bytes=cfg.bucket_bytes,
                            normalize=self.normalize, synchronize=sync, noise=noise, precision=self.precision))

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> TrainResult:
        cfg = self.config
        try:
            with stop_request() if self._own_stop else contextlib.nullcontext(self.stop) as stop:
                self.stop = stop
                path = self.find_resume_point()
                if path is not None:
                    self.restore(path)
                self.on_start(self)
                while self.epoch < cfg.epochs and self.stopped_by is None:
                    self.train_epoch()
                    if self.stopped_by is None:
                        self.finish_epoch()
                if self.stopped_by is not None and self.stopped_by != "target":
                    self.save()
        finally:
            self.loader.close()
            self.val_loader.close()
            self.strategy.close()
        return self.result()

    def train_epoch(self) -> None:
        """Train the rest of the current epoch: steps while the rank has a batch for every learner."""
        cfg = self.config
        batches: Generator[tuple[Any, Any], None, None] | None = None
        try:
            while self.stopped_by is None:
                k = self.strategy.learners
                _, done = self.loader.position
                if self.batches_per_epoch - done < k:
                    break                                     # the epoch's last few batches are left out
                if self.shuffle_round() != self.store.round:
                    if batches is not None:
                        batches.close()
                        batches = None
                    self.tally.shuffle_seconds += self.reshuffle()
                if batches is None:
                    batches = self.loader.epoch(self.epoch)
                self.loader.prefetch = max(2, 2 * k)
                t0 = time.perf_counter()
                position = self.epoch * self.batches_per_epoch + done
                mine = [next(batches) for _ in range(k)]
                waited = time.perf_counter() - t0
                lr = self.schedule.lr(position)
                self.maybe_restart(position)
                last = self.batches_per_epoch - done - k < k
                sync = last or self.since_sync + 1 >= cfg.sync_every
                result = self.strategy.step(mine, lr, sync=sync, stop=bool(self.stop),
                                            times=StepTimes(data=waited))
                self.step += 1
                self.since_sync = 0 if result.synced else self.since_sync + 1
                seconds = time.perf_counter() - t0
                self.tally.add(result, seconds)
                self.train_seconds += seconds
                self.images += int(result.samples)
                self.on_step(1)
                for event in result.events:
                    self.on_event(event)
                if not result.finite:
                    raise TrainingDiverged(f"training diverged at step {self.step} (loss {result.loss_sum:.4g}, "
                                    f"or a non-finite update); nothing was saved after it, the last good "
                                    f"checkpoint is {self.last_checkpoint or 'none'}; lower `lr`"
                                    + (" or `alpha`" if cfg.sync == "sma" else "")
                                    + " or add `warmup_epochs`")
                if result.stop:
                    self.stopped_by = self.stop.received or "a signal on another rank"
                    break
                if result.synced and not last and self.eval_due():
                    self.evaluate_now()                       # may reach the target and end the run
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and not last:
                    self.save()
        except StopIteration:
            raise RuntimeError("the loader ended its epoch before batches_per_epoch batches") from None
        finally:
            if batches is not None:
                batches.close()
        if self.stopped_by is None:
            self.loader.seek(self.epoch + 1)

    def finish_epoch(self) -> None:
        """Evaluate the model, record the epoch, checkpoint."""
        evaluation = self.evaluate()
        self.epoch += 1
        self.history.append(self.epoch_metrics(evaluation))
        self.record_evaluation(evaluation)
        self.tally = EpochTally()
        self.save()
        self.on_epoch(self.history[-1])

    # -- the step's helpers -------------------------------------------------------------------

    def shuffle_round(self) -> int | None:
        """The store round this position should hold (None: still in load order)."""
        every = self.config.shuffle_every
        if every is None:
            return None
        if every == 0:
            return self.epoch if self.epoch > 0 else None
        return self.step // every if self.step >= every else None

    def reshuffle(self) -> float:
        t0 = time.perf_counter()
        self.loader.close()  # no decoder may read the store while records move
        self.store.shuffle(self.config.seed, self.shuffle_round())  # type: ignore[arg-type]  # MPI: records move between ranks
        return time.perf_counter() - t0

    def lr_phase_at(self, position: int) -> int:
        """How many milestones of the step schedule lie at or before ``position`` (in batches)."""
        if self.schedule.kind != "step":
            return 0
        return sum(1 for m in self.schedule.milestones if position >= m * self.batches_per_epoch)

    def maybe_restart(self, position: int) -> None:
        """SMA restarts (every learner <- z) when the step schedule passes a milestone."""
        phase = self.lr_phase_at(position)
        if phase > self.lr_phase:
            if self.strategy.restart():
                self.on_event(f"restart at step {self.step} (epoch {position / self.batches_per_epoch:g}): "
                              f"the learning rate drops to {self.schedule.lr(position):.4g}, every learner "
                              f"starts again from the central model")
        self.lr_phase = phase

    def eval_due(self) -> bool:
        return bool(self.eval_every_images) and self.images >= self.next_eval_images

    def evaluate_now(self) -> None:
        """An evaluation between epoch ends (``eval_every_images``); may end the run at the target."""
        self.record_evaluation(self.evaluate())

    def record_evaluation(self, evaluation: EvalResult) -> None:
        """Note an evaluation (the epoch end's counts as the periodic one that is due) and check the target."""
        while self.eval_every_images and self.next_eval_images <= self.images:
            self.next_eval_images += self.eval_every_images
        epoch, done = self.loader.position
        self.evaluations.append(Evaluation(epoch=epoch + done / self.batches_per_epoch, images=self.images,
                                           elapsed=time.perf_counter() - self.started,
                                           top1=evaluation.top1, top5=evaluation.top5, loss=evaluation.loss,
                                           step=self.step, train_seconds=self.train_seconds))
        if self.target_top1 is not None and evaluation.top1 >= self.target_top1 and self.stopped_by is None:
            self.stopped_by = "target"
            self.on_event(f"validation top-1 {100 * evaluation.top1:.2f}% reaches the target "
                          f"{100 * self.target_top1:.2f}% after {self.images} training images")

    def evaluate(self) -> EvalResult:
        from mpi4py import MPI

        t0 = time.perf_counter()
        model = self.strategy.eval_model()
        with self.precision.autocast():
            counts = local_counts(model, self.val_loader.epoch(0), self.normalize, label_map=self.val_label_map)
        self.comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)   # MPI: every rank scored its share
        return summarize(counts, time.perf_counter() - t0)

    def epoch_metrics(self, evaluation: EvalResult) -> EpochMetrics:
        from mpi4py import MPI

        tally = self.tally
        split = np.array(list(tally.times.as_dict().values()), np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, split, op=MPI.SUM)   # MPI: the time split averaged over ranks
        split /= self.world
        samples = max(tally.samples, 1)
        train_s = tally.train_seconds
        strategy = self.strategy.figures()
        return EpochMetrics(
            epoch=self.epoch, step=self.step,
            lr=self.schedule.lr(max(self.epoch * self.batches_per_epoch - 1, 0)),
            train_loss=tally.loss_sum / samples, train_top1=tally.correct / samples,
            val_loss=evaluation.loss, val_top1=evaluation.top1, val_top5=evaluation.top5,
            images=int(tally.samples), images_per_s=tally.samples / train_s if train_s > 0 else 0.0,
            seconds=train_s + tally.shuffle_seconds + evaluation.seconds, train_seconds=train_s,
            eval_seconds=evaluation.seconds, shuffle_seconds=tally.shuffle_seconds,
            time_split=dict(zip(TIME_SPLIT, split.tolist())),
            elapsed=time.perf_counter() - self.started, sync=self.strategy.name,
            learners_per_rank=self.strategy.learners, alpha=strategy.get("alpha"),
            synchronisations=tally.synchronisations, **{k: strategy[k] for k in NOISE_FIELDS if k in strategy})

    def result(self) -> TrainResult:
        figures = self.strategy.figures()
        result = TrainResult(
            config=self.config, model=self.model_info, world_size=self.world, device=str(self.device),
            allreduce=self.algorithm, allreduce_choice=self.algorithm_choice,
            steps_per_epoch=self.steps_per_epoch, global_batch=self.global_batch,
            lr_batch=self.lr_batch,
            schedule={"kind": self.schedule.kind, "peak_lr": self.schedule.peak_lr,
                      "warmup_steps": self.schedule.warmup_steps, "milestones": list(self.schedule.milestones),
                      "total_steps": self.schedule.total_steps, "counts": "batches per rank"},
            sync=self.strategy.name, strategy={k: v for k, v in figures.items() if k != "learners_per_rank"},
            epochs=self.history, evaluations=self.evaluations, resumed_from=self.resumed_from,
            stopped_by=self.stopped_by, checkpoint=self.last_checkpoint)
        result.replicas_identical = self.strategy.identical(self.comm)   # MPI: the ranks' models agree
        result.seconds = time.perf_counter() - self.started
        return result

    # -- checkpoints ------------------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """What a mid-epoch resume needs unchanged: the data's split over ranks and learners."""
        cfg = self.config
        return {"world_size": self.world, "groups": cfg.groups, "batch_size": cfg.batch_size,
                "learners": cfg.learners if cfg.sync == "sma" else None, "sync_every": cfg.sync_every,
                "shuffle_every": cfg.shuffle_every}

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Collective: gather every rank's local state; the whole checkpoint on rank 0, else None."""
        model = self.strategy.eval_model()   # collective for SMA (averaged batch-norm statistics)
        local = {"strategy": self.strategy.local_state(), "loader": self.loader.state_dict(),
                 "torch_rng": torch.get_rng_state()}
        everyone = self.comm.gather(local, root=0)   # MPI: rank 0 writes every rank's state
        if self.rank != 0:
            return None
        epoch, done = self.loader.position
        return {
            "sync": self.strategy.name, "model_name": self.config.model, "classes": list(self.store.classes),
            "config": self.config.as_dict(), "layout": self.layout(), "world_size": self.world,
            "epoch": self.epoch, "step": self.step,
            # The schedule's position, in epochs and batches of the loader: it does not depend on P.
            "position": {"epoch": self.epoch, "batch": done if epoch == self.epoch else 0,
                         "batches_per_epoch": self.batches_per_epoch},
            "since_sync": self.since_sync, "lr_phase": self.lr_phase, "images": self.images,
            "train_seconds": self.train_seconds,
            "next_eval_images": self.next_eval_images,
            "lr": self.schedule.lr(max(self.epoch * self.batches_per_epoch + done - 1, 0)),
            "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "strategy": self.strategy.global_state(),
            "ranks": everyone, "store_round": self.store.round,
            "tally": self.tally.as_dict(),
            "history": [m.as_dict() for m in self.history],
            "evaluations": [e.__dict__ for e in self.evaluations],
        }

    def save(self) -> str | None:
        """Collective: rank 0 writes a checkpoint; every rank learns its path (or the error).

        A model that is not finite is never saved (it would rotate a good checkpoint out).
        """
        cfg = self.config
        if cfg.checkpoint_dir is None:
            return None
        state = self.checkpoint_state()
        outcome: tuple[str | None, str | None] = (None, None)
        if self.rank == 0:
            assert state is not None
            bad = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
            if bad:
                outcome = (None, f"the model is not finite ({bad[0]}); not saved, the last good checkpoint "
                                 f"is {self.last_checkpoint or 'none'}")
            else:
                try:
                    outcome = (str(save_checkpoint(cfg.checkpoint_dir, state, keep=cfg.keep_checkpoints)), None)
                except DimdError as exc:
                    outcome = (None, str(exc))
        path, problem = self.comm.bcast(outcome, root=0)   # MPI: every rank learns the outcome
        if problem is not None:
            raise DimdError(problem)
        self.last_checkpoint = path
        return path

    def find_resume_point(self) -> str | None:
        cfg = self.config
        path = None
        if self.rank == 0:
            if cfg.resume_from:
                path = cfg.resume_from
            elif cfg.resume:
                found = latest_checkpoint(cfg.checkpoint_dir)  # type: ignore[arg-type]
                path = str(found) if found else None
        return self.comm.bcast(path, root=0)   # MPI: rank 0 chooses for everyone

    def restore(self, path: str) -> None:
        """Continue from the checkpoint at ``path``: exactly on the same layout, from an epoch boundary otherwise."""
        state = upgrade(load_checkpoint(path), self.store.total)
        cfg = self.config
        saved_sync = state.get("sync", "ssgd")
        if saved_sync != cfg.sync:
            raise DimdError(f"{path}: a checkpoint of a `sync` {saved_sync} run, this run is `sync` "
                            f"{cfg.sync}; resume it with `sync` {saved_sync} (or start afresh without `resume`)")
        if state["model_name"] != cfg.model:
            raise DimdError(f"{path}: checkpoint of model {state['model_name']!r}, not {cfg.model!r}")
        if list(state["classes"]) != list(self.store.classes):
            raise DimdError(f"{path}: checkpoint has {len(state['classes'])} classes, {cfg.train} has "
                            f"{len(self.store.classes)}")
        position = state.get("position") or {"epoch": state["epoch"], "batch": 0}
        same_layout = state.get("layout") == self.layout()
        if not same_layout and position["batch"]:
            raise DimdError(self.mid_epoch_problem(path, state))
        try:
            self.model.load_state_dict(state["model"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise DimdError(f"{path}: does not fit this model ({str(exc).splitlines()[0]})") from None
        mine: dict[str, Any] = state["ranks"][self.rank] if same_layout else {}
        try:
            notes = self.strategy.load_state(state["strategy"], mine["strategy"] if same_layout else None)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise DimdError(f"{path}: does not fit this run ({str(exc).splitlines()[0]})") from None
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.images, self.next_eval_images = int(state["images"]), int(state["next_eval_images"])
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.history = [EpochMetrics.from_dict(m) for m in state["history"]]
        self.evaluations = [Evaluation(**e) for e in state.get("evaluations", [])]
        if state["store_round"] is not None:
            self.store.shuffle(cfg.seed, int(state["store_round"]))   # MPI: the records' placement, replayed
        if same_layout:
            self.loader.load_state_dict(mine["loader"])
            torch.set_rng_state(mine["torch_rng"])
            self.tally = EpochTally.from_dict(state["tally"])
            self.since_sync, self.lr_phase = int(state["since_sync"]), int(state["lr_phase"])
        else:
            self.loader.seek(self.epoch)
            self.lr_phase = self.lr_phase_at(max(self.epoch * self.batches_per_epoch - 1, 0))
            old = state.get("layout") or {"world_size": state["world_size"]}
            notes.insert(0, f"the checkpoint's layout ({describe_layout(old)}) differs from this run's "
                            f"({describe_layout(self.layout())}); continuing from the end of epoch {self.epoch}")
        self.resumed_from = path
        self.on_event(f"resumed from {path} at epoch {self.epoch}, step {self.step}")
        for note in notes:
            self.on_event(note)

    def mid_epoch_problem(self, path: str, state: dict[str, Any]) -> str:
        """What to do with a mid-epoch checkpoint on another layout: the exact alternatives."""
        old = state.get("layout") or {"world_size": state["world_size"], "groups": state["config"]["groups"],
                                      "batch_size": state["config"]["batch_size"]}
        folder = os.path.dirname(os.path.abspath(path))
        earlier = [p for p in list_checkpoints(folder) if checkpoint_step(p) <= int(state["step"])]
        boundary = [p for p in earlier if _at_epoch_boundary(p)]
        alternative = (f", or resume from {boundary[-1]} (an epoch boundary) on any layout" if boundary
                       else "; no epoch-boundary checkpoint is beside it")
        return (f"{path}: written mid-epoch (epoch {state['epoch'] + 1}, step {state['step']}) with "
                f"{describe_layout(old)}; this run has {describe_layout(self.layout())}: resume it with "
                f"that layout{alternative}")


def upgrade(state: dict[str, Any], total: int) -> dict[str, Any]:
    """A version-1 checkpoint (S-SGD only, before the strategies) in today's terms."""
    if int(state.get("version", 1)) >= 2:
        return state
    config = state["config"]
    per_epoch = total // (state["world_size"] * config["batch_size"])
    return {**state, "sync": "ssgd", "layout": None, "strategy": {"optimizer": state["optimizer"]},
            "position": {"epoch": state["epoch"], "batch": state["step"] - state["epoch"] * per_epoch,
                         "batches_per_epoch": per_epoch},
            "images": 0, "next_eval_images": 0, "tally": {}, "since_sync": 0, "lr_phase": 0,
            "ranks": [{**r, "strategy": {"buffers": r["buffers"]}} for r in state["ranks"]]}


def describe_layout(layout: dict[str, Any]) -> str:
    parts = [f"{layout.get('world_size')} ranks"]
    if layout.get("learners") is not None:
        parts.append(f"{layout['learners']} learners per rank")
    if layout.get("groups") is not None:
        parts.append(f"groups {layout['groups']}")
    if layout.get("batch_size") is not None:
        parts.append(f"batch {layout['batch_size']}")
    if layout.get("sync_every", 1) != 1:
        parts.append(f"sync every {layout['sync_every']}")
    if "shuffle_every" in layout:
        every = layout["shuffle_every"]
        parts.append("shuffle " + ("never" if every is None else "every epoch" if every == 0 else f"every {every}"))
    return ", ".join(parts)


def _at_epoch_boundary(path) -> bool:
    """Whether a checkpoint file was written at an epoch's end (reads only its position)."""
    try:
        state = load_checkpoint(path)
    except DimdError:
        return False
    position = state.get("position") or {}
    return position.get("batch", 1) == 0


def train(config: TrainConfig, comm, **options: Any) -> TrainResult:
    """Run ``config`` on every rank of ``comm``; see :class:`Trainer`."""
    return Trainer(config, comm, **options).run()
