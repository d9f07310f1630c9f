"""The synchronous data-parallel SGD engine (DIMD paper, sections 3 and 5).

Collective over ``comm``: every rank loads its share of the packed training
and validation sets into memory (:class:`dimd.shuffle.DistributedStore`),
builds the same model (rank 0's weights broadcast), and per step computes
gradients on its own batch, sums them with one allreduce of the flat gradient
buffer and applies the same update. The store is reshuffled across the ranks
of each group at every epoch start (or every ``shuffle_every`` steps).
Rank 0 writes checkpoints; a SIGTERM/SIGUSR1 ends the run cleanly after a
checkpoint. The library never prints: progress goes to callbacks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from dimd.errors import DimdError
from dimd.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dimd.train.config import TrainConfig
from dimd.train.evaluate import EvalResult, local_counts, summarize
from dimd.train.models import MODELS, build_model, gradient_bytes, parameter_count
from dimd.train.schedule import Schedule, make_schedule
from dimd.train.sgd import (Normalize, StepTimes, SyncSGD, broadcast_state, make_optimizer,
                            replicas_identical)
from dimd.train.signals import StopRequest, stop_request


@dataclass
class EpochMetrics:
    """One line of ``--metrics``: the epoch's training and validation figures and time split."""

    epoch: int                    # 1-based: epochs finished
    step: int                     # optimizer steps taken so far
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
    time_split: dict[str, float]  # per-rank seconds, averaged over ranks: data/compute/allreduce/optimizer

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TrainResult:
    config: TrainConfig
    model: dict[str, Any]
    world_size: int
    device: str
    allreduce: str
    allreduce_choice: dict[str, Any]
    steps_per_epoch: int
    global_batch: int
    schedule: dict[str, Any]
    epochs: list[EpochMetrics] = field(default_factory=list)
    resumed_from: str | None = None
    stopped_by: str | None = None       # the signal that ended the run early
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
        split = {k: sum(e.time_split[k] for e in run) for k in ("data", "compute", "allreduce", "optimizer")}
        final = self.final
        return {
            "model": self.model, "world_size": self.world_size, "device": self.device,
            "allreduce": self.allreduce, "allreduce_choice": self.allreduce_choice,
            "steps_per_epoch": self.steps_per_epoch, "global_batch": self.global_batch,
            "schedule": self.schedule, "resumed_from": self.resumed_from, "stopped_by": self.stopped_by,
            "checkpoint": self.checkpoint, "replicas_identical": self.replicas_identical,
            "seconds": self.seconds, "epochs_run": len(run),
            "images_per_s": images / train_s if train_s > 0 else 0.0,
            "time_split": split,
            "final": final.as_dict() if final else None,
            "val_top1": final.val_top1 if final else None,
            "val_top5": final.val_top5 if final else None,
            "history": [e.as_dict() for e in self.epochs],
        }


Callback = Callable[..., None]


def pick_device(choice: str, comm) -> torch.device:
    """``auto``: CUDA when present (one GPU per rank on a node, by node-local rank), else CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DimdError("device cuda: this torch build or machine has no CUDA device")
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    index = local.Get_rank() % torch.cuda.device_count()
    local.Free()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def choose_allreduce(config: TrainConfig, nbytes: int, comm) -> tuple[str, dict[str, Any]]:
    """The requested algorithm, or the fastest measured now for this gradient size."""
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


def make_reducer(algorithm: str, comm) -> Callable[[np.ndarray], None]:
    from dimd.allreduce import allreduce

    def reduce(array: np.ndarray) -> None:
        allreduce(array, comm, algorithm)

    return reduce


class Trainer:
    """One training run; :meth:`run` is collective over ``comm``."""

    def __init__(self, config: TrainConfig, comm, *, on_epoch: Callback | None = None,
                 on_step: Callback | None = None, on_event: Callback | None = None,
                 on_start: Callback | None = None) -> None:
        self.config = config
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.on_epoch = on_epoch or (lambda metrics: None)
        self.on_step = on_step or (lambda n: None)
        self.on_event = on_event or (lambda message: None)
        self.on_start = on_start or (lambda trainer: None)

    # -- set-up -----------------------------------------------------------------------------

    def setup(self) -> None:
        from dimd.shuffle import BatchLoader, DistributedStore

        cfg, comm = self.config, self.comm
        if cfg.model not in MODELS:
            build_model(cfg.model, 1)  # raises the clear "unknown model" error
        if cfg.threads or "OMP_NUM_THREADS" not in os.environ:
            from dimd.host import available_cores
            from dimd.mpi import node_local_ranks

            torch.set_num_threads(cfg.threads or max(1, available_cores() // node_local_ranks(comm)))
        self.device = pick_device(cfg.device, comm)
        t0 = time.perf_counter()
        self.store = DistributedStore.load(cfg.train, comm, groups=cfg.groups, memory_limit=cfg.memory_limit)
        self.val_store = DistributedStore.load(cfg.val, comm, groups=1, memory_limit=cfg.memory_limit)
        self.val_label_map = val_label_map(self.store.classes, self.val_store.classes, cfg.val, cfg.train)
        self.on_event(f"loaded {self.store.total} training and {self.val_store.total} validation records "
                      f"into memory in {time.perf_counter() - t0:.1f}s")
        pin = self.device.type == "cuda"
        source = self.store
        if cfg.read_from == "files":
            from dimd.train.filesource import OriginalFiles

            source = OriginalFiles(self.store, cfg.files_root)
        self.loader = BatchLoader(source, cfg.batch_size, cfg.image_size, train=True,
                                  workers=cfg.decode_threads, seed=cfg.seed, pin_memory=pin,
                                  crop_scale=cfg.crop_scale)
        self.val_loader = BatchLoader(self.val_store, cfg.eval_batch_size or cfg.batch_size,
                                      cfg.image_size, train=False, workers=cfg.decode_threads, seed=cfg.seed,
                                      pin_memory=pin)
        self.steps_per_epoch = self.loader.steps_per_epoch
        self.global_batch = cfg.batch_size * self.world

        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.model, len(self.store.classes),
                                 zero_init_residual=cfg.zero_init_residual).to(self.device)
        broadcast_state(self.model, comm)
        self.schedule: Schedule = make_schedule(
            cfg.schedule, cfg.lr, global_batch=self.global_batch, steps_per_epoch=self.steps_per_epoch,
            epochs=cfg.epochs, scaling=cfg.lr_scaling, warmup_epochs=cfg.warmup_epochs,
            milestones=cfg.milestones, power=cfg.power)  # type: ignore[arg-type]
        optimizer = make_optimizer(self.model, lr=self.schedule.lr(0), momentum=cfg.momentum,
                                   weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
                                   decay_bn_and_bias=cfg.decay_bn_and_bias)
        nbytes = gradient_bytes(self.model)
        self.algorithm, self.algorithm_choice = choose_allreduce(cfg, nbytes, comm)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self.sgd = SyncSGD(self.model, optimizer, make_reducer(self.algorithm, comm), self.world,
                           bucket_bytes=cfg.bucket_bytes, normalize=Normalize(self.device),
                           synchronize=sync)
        self.model_info = {"name": cfg.model, "parameters": parameter_count(self.model),
                           "gradient_bytes": nbytes, "classes": len(self.store.classes)}
        self.epoch, self.step = 0, 0
        self.history: list[EpochMetrics] = []
        self.partial = np.zeros(4, np.float64)   # this epoch so far: loss sum, correct, samples, seconds
        self.partial_times = StepTimes()
        self.resumed_from: str | None = None
        self.last_checkpoint: str | None = None

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Collective: gather every rank's local state; the whole checkpoint on rank 0, else None."""
        local = {"buffers": {k: v.detach().cpu().clone() for k, v in self.model.named_buffers()},
                 "loader": self.loader.state_dict(), "torch_rng": torch.get_rng_state()}
        everyone = self.comm.gather(local, root=0)
        if self.rank != 0:
            return None
        return {
            "model_name": self.config.model, "classes": list(self.store.classes),
            "config": self.config.as_dict(), "world_size": self.world, "epoch": self.epoch,
            "step": self.step, "lr": self.schedule.lr(max(self.step - 1, 0)),
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.sgd.optimizer.state_dict(),
            "ranks": everyone, "store_round": self.store.round,
            "partial": self.partial.copy(), "partial_times": self.partial_times.as_dict(),
            "history": [m.as_dict() for m in self.history],
        }

    def save(self) -> str | None:
        """Collective: rank 0 writes a checkpoint; every rank learns its path (or an error)."""
        if self.config.checkpoint_dir is None:
            return None
        state = self.checkpoint_state()
        path = None
        if self.rank == 0:
            path = str(save_checkpoint(self.config.checkpoint_dir, state, keep=self.config.keep_checkpoints))
        self.last_checkpoint = self.comm.bcast(path, root=0)
        return self.last_checkpoint

    def find_resume_point(self) -> str | None:
        cfg = self.config
        path = None
        if self.rank == 0:
            if cfg.resume_from:
                path = cfg.resume_from
            elif cfg.resume:
                found = latest_checkpoint(cfg.checkpoint_dir)  # type: ignore[arg-type]
                path = str(found) if found else None
        return self.comm.bcast(path, root=0)

    def restore(self, path: str) -> None:
        state = load_checkpoint(path)
        cfg = self.config
        if state["model_name"] != cfg.model:
            raise DimdError(f"{path}: checkpoint of model {state['model_name']!r}, not {cfg.model!r}")
        if list(state["classes"]) != list(self.store.classes):
            raise DimdError(f"{path}: checkpoint has {len(state['classes'])} classes, {cfg.train} has "
                            f"{len(self.store.classes)}")
        try:
            self.model.load_state_dict(state["model"])
            self.sgd.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise DimdError(f"{path}: does not fit this model ({str(exc).splitlines()[0]})") from None
        self.sgd.flat.attach()
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        if state["store_round"] is not None:
            self.store.shuffle(cfg.seed, int(state["store_round"]))
        same_layout = state["world_size"] == self.world and state["config"]["groups"] == cfg.groups
        if same_layout:
            mine = state["ranks"][self.rank]
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(mine["buffers"][name])
            self.loader.load_state_dict(mine["loader"])
            torch.set_rng_state(mine["torch_rng"])
            self.partial = np.asarray(state["partial"], np.float64)
            self.partial_times = StepTimes(**state["partial_times"])
        elif self.step != self.epoch * self.steps_per_epoch:
            raise DimdError(f"{path}: written mid-epoch on {state['world_size']} ranks (groups "
                            f"{state['config']['groups']}); resume it on the same layout")
        else:
            self.loader.load_state_dict({**self.loader.state_dict(), "epoch": self.epoch, "step": 0})
        self.history = [EpochMetrics(**m) for m in state["history"]]
        self.resumed_from = path

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> TrainResult:
        start = time.perf_counter()
        cfg = self.config
        stopped_by = None
        with stop_request() as stop:  # a signal during start-up stops the run after its first step
            self.setup()
            try:
                path = self.find_resume_point()
                if path is not None:
                    self.restore(path)
                    self.on_event(f"resumed from {path} at epoch {self.epoch}, step {self.step}")
                self.on_start(self)
                while self.epoch < cfg.epochs and stopped_by is None:
                    stopped_by = self.run_epoch(stop)
            finally:
                self.loader.close()
                self.val_loader.close()
        result = TrainResult(
            config=cfg, model=self.model_info, world_size=self.world, device=str(self.device),
            allreduce=self.algorithm, allreduce_choice=self.algorithm_choice,
            steps_per_epoch=self.steps_per_epoch, global_batch=self.global_batch,
            schedule={"kind": self.schedule.kind, "peak_lr": self.schedule.peak_lr,
                      "warmup_steps": self.schedule.warmup_steps,
                      "milestones": list(self.schedule.milestones), "total_steps": self.schedule.total_steps},
            epochs=self.history, resumed_from=self.resumed_from, stopped_by=stopped_by,
            checkpoint=self.last_checkpoint)
        result.replicas_identical = replicas_identical(self.model, self.comm)
        result.seconds = time.perf_counter() - start
        return result

    def shuffle_round(self) -> int | None:
        """The store round this position should hold (None: still in load order)."""
        every = self.config.shuffle_every
        if every is None:
            return None
        if every == 0:
            return self.epoch if self.epoch > 0 else None
        return self.step // every if self.step >= every else None

    def maybe_shuffle(self) -> float:
        wanted = self.shuffle_round()
        if wanted is None or wanted == self.store.round:
            return 0.0
        t0 = time.perf_counter()
        self.loader.close()  # no decoder may read the store while records move
        self.store.shuffle(self.config.seed, wanted)
        return time.perf_counter() - t0

    def run_epoch(self, stop: StopRequest) -> str | None:
        """Train the rest of the current epoch, evaluate, checkpoint; the signal's name if stopped."""
        cfg = self.config
        epoch_start = time.perf_counter()
        shuffle_s = self.maybe_shuffle()
        train_start = time.perf_counter()
        last_step = (self.epoch + 1) * self.steps_per_epoch
        stopped = None
        while self.step < last_step and stopped is None:
            batches = self.loader.epoch(self.epoch)
            try:
                while self.step < last_step:
                    t0 = time.perf_counter()
                    images, labels = next(batches)
                    waited = time.perf_counter() - t0
                    self.sgd.set_lr(self.schedule.lr(self.step))
                    result = self.sgd.step(images, labels, stop=bool(stop))
                    result.times.data = waited
                    self.step += 1
                    self.partial += (result.loss_sum, result.correct, result.samples, 0.0)
                    self.partial_times.add(result.times)
                    self.on_step(1)
                    if not np.isfinite(result.loss_sum):
                        raise DimdError(f"training diverged at step {self.step} (loss is "
                                        f"{result.loss_sum}); lower `lr` or add `warmup_epochs`")
                    if result.stop:
                        stopped = stop.received or "a signal on another rank"
                        break
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < last_step:
                        self.partial[3] += time.perf_counter() - train_start
                        train_start = time.perf_counter()
                        self.save()
                    if self.shuffle_round() != self.store.round:
                        break  # leave the loader to move records between ranks
            except StopIteration:
                raise RuntimeError("the loader ended its epoch before steps_per_epoch batches") from None
            finally:
                batches.close()
            if stopped is None:
                shuffle_s += self.maybe_shuffle()
        self.partial[3] += time.perf_counter() - train_start
        if stopped is not None:
            self.save()
            return stopped
        # The loader's position moves to the next epoch once its generator is exhausted.
        self.loader.load_state_dict({**self.loader.state_dict(), "epoch": self.epoch + 1, "step": 0})
        evaluation = self.evaluate()
        self.epoch += 1
        self.history.append(self.epoch_metrics(evaluation, time.perf_counter() - epoch_start, shuffle_s))
        self.partial[:] = 0
        self.partial_times = StepTimes()
        self.save()
        self.on_epoch(self.history[-1])
        return None

    def evaluate(self) -> EvalResult:
        t0 = time.perf_counter()
        counts = local_counts(self.model, self.val_loader.epoch(0), self.sgd.normalize,
                              label_map=self.val_label_map)
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
        return summarize(counts, time.perf_counter() - t0)

    def epoch_metrics(self, evaluation: EvalResult, seconds: float, shuffle_s: float) -> EpochMetrics:
        from mpi4py import MPI

        loss_sum, correct, samples, train_s = self.partial
        split = np.array(list(self.partial_times.as_dict().values()), np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, split, op=MPI.SUM)
        split /= self.world
        return EpochMetrics(
            epoch=self.epoch, step=self.step, lr=self.schedule.lr(self.step - 1),
            train_loss=loss_sum / max(samples, 1), train_top1=correct / max(samples, 1),
            val_loss=evaluation.loss, val_top1=evaluation.top1, val_top5=evaluation.top5,
            images=int(samples), images_per_s=samples / train_s if train_s > 0 else 0.0,
            seconds=seconds, train_seconds=float(train_s), eval_seconds=evaluation.seconds,
            shuffle_seconds=shuffle_s,
            time_split=dict(zip(("data", "compute", "allreduce", "optimizer"), split.tolist())))


def train(config: TrainConfig, comm, **callbacks: Callback) -> TrainResult:
    """Run ``config`` on every rank of ``comm``; see :class:`Trainer`."""
    return Trainer(config, comm, **callbacks).run()
