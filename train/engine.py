"""The training engine: S-SGD (DIMD paper, sections 3 and 5) and SMA (Crossbow, section 3) in one loop.

Collective over ``comm``: the run plan (:mod:`dimd.train.run_plan`) loads every
rank's share of the packed training and validation sets into memory and
builds the same model (rank 0's weights broadcast). Then each step

1. takes this rank's next batches from the loader, one per learner,
2. asks the schedule where the step falls (:class:`~dimd.train.steps.StepPlace`:
   the learning rate, the milestones passed, whether it ends the epoch),
3. hands both to the synchronisation strategy (:mod:`dimd.train.steps`):
   S-SGD's gradient allreduce (:class:`dimd.train.sgd.SSGD`) or SMA's model
   averaging (:class:`dimd.train.sma.SMA`), which keeps its own cadence,
4. adds the step to the epoch's tally, checkpoints or reshuffles if due.

At an epoch's end: evaluate (the replica, or SMA's central model z), record
the epoch, checkpoint. Rank 0 writes checkpoints (:mod:`dimd.train.checkpoint`
saves and restores the run); a SIGTERM/SIGUSR1 ends the run cleanly after a
checkpoint. The records it reports are in :mod:`dimd.train.results`. The
library never prints: progress goes to :class:`Hooks`. Lines that exist only
because the program is distributed carry a ``# MPI:`` comment.

This module is the loop (:meth:`Trainer.run`, :meth:`Trainer.train_epoch`,
:meth:`Trainer.finish_epoch`) and what it calls; the set-up before it, and
every choice made there with its reason, is :func:`dimd.train.run_plan.plan_run`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

import numpy as np
import torch

from dimd.errors import DimdError
from dimd.shuffle.memory import describe_ranks, gather_rank_memory
from dimd.stall import watch_job
from dimd.train.checkpoint import RunState, restore_run, save_run
from dimd.train.config import TrainConfig
from dimd.train.evaluate import EvalResult, local_counts, summarize
from dimd.train.results import NOISE_FIELDS, EpochMetrics, EpochTally, Evaluation, TrainResult
from dimd.train.run_plan import plan_run, prefetch_for
from dimd.train.signals import StopRequest, first_signal, stop_request
from dimd.train.steps import TIME_SPLIT, StepPlace, StepTimes


class TrainingDiverged(DimdError):
    """The loss or the synchronised update stopped being finite (every rank raises it at the same step)."""


def _ignore(*_: Any) -> None:
    return None


@dataclass
class Hooks:
    """What the caller hears of a run (the library never prints); every hook is optional."""

    on_start: Callable[[Any], None] = _ignore          # the Trainer, set up (and resumed), before the first step
    on_step: Callable[[int], None] = _ignore           # steps just taken (for a progress bar)
    on_epoch: Callable[[EpochMetrics], None] = _ignore  # an epoch's record, once it is evaluated and saved
    on_event: Callable[[str], None] = _ignore          # a line worth logging (loaded, resumed, restarted...)


class Trainer:
    """One training run: the constructor sets it up (collective over ``comm``), :meth:`run` trains.

    ``eval_every_images`` adds an evaluation whenever that many more training
    images (all ranks) have been processed; ``target_top1`` ends the run
    (``stopped_by == "target"``) at the first evaluation that reaches it.
    ``stop``: the stop signals' flag; the caller enters it before this set-up,
    so that a signal during loading is not lost, or :meth:`run` takes the
    process-wide one (:func:`~dimd.train.signals.stop_request`). ``device``
    and ``graph_backend`` go to :func:`~dimd.train.run_plan.plan_run`, whose
    :class:`~dimd.train.run_plan.RunPlan` is :attr:`plan`.
    """

    def __init__(self, config: TrainConfig, comm, *, stop: StopRequest | None = None, hooks: Hooks | None = None,
                 eval_every_images: int | None = None, target_top1: float | None = None,
                 device: torch.device | None = None, graph_backend: Any = None) -> None:
        self.started = time.perf_counter()
        self.hooks = hooks or Hooks()
        self.stop = stop if stop is not None else StopRequest()
        self._own_stop = stop is None
        self.eval_every_images = eval_every_images
        #: A fraction: the caller's, else the config's percent (``target_top1``).
        self.target_top1 = target_top1 if target_top1 is not None or config.target_top1 is None \
            else config.target_top1 / 100
        self.target_reached: dict[str, Any] | None = None   # where the run reached it: time, epochs, updates
        self.plan = plan = plan_run(config, comm, on_event=self.hooks.on_event, device=device,
                                    graph_backend=graph_backend)
        # MPI: a wait for the other ranks that outlasts `stall_timeout` (a peer's host is gone) ends the job
        self.watchdog = watch_job(comm, config.stall_timeout)
        # -- what the loop and its checkpoints (RunParts) read, by name; the rest it reads from the plan
        self.config, self.comm, self.world, self.model = config, comm, plan.world, plan.model
        self.store, self.loader, self.val_loader = plan.store, plan.loader, plan.val_loader
        self.strategy, self.schedule, self.batches_per_epoch = plan.strategy, plan.schedule, plan.batches_per_epoch
        self.fit_prefetch()
        # -- where the run stands (a checkpoint restores it) and how it ended
        self.state = RunState(next_eval_images=eval_every_images or 0)
        self.stopped_by: str | None = None       # the signal (or "target") that ended the run early
        self.resumed_from: str | None = None
        self.last_checkpoint: str | None = None
        self.memory: list[dict[str, int]] = []   # each rank's memory at the last epoch's end (dimd.shuffle.memory)

    @property
    def steps_per_epoch(self) -> int:
        """Steps in an epoch: one per batch under S-SGD, one per K batches (one each) under SMA."""
        return self.batches_per_epoch // self.strategy.learners

    @property
    def global_batch(self) -> int:
        """Images per step over all ranks (and all learners)."""
        return self.config.batch_size * self.world * self.strategy.learners

    def run(self) -> TrainResult:
        cfg = self.config
        try:
            with stop_request() if self._own_stop else contextlib.nullcontext(self.stop) as stop, self.watchdog:
                self.stop = stop
                self.resume()
                self.fit_prefetch()   # a resumed auto-tuner may have chosen other learners
                self.hooks.on_start(self)
                while self.state.epoch < cfg.epochs and self.stopped_by is None:
                    self.train_epoch()
                    if self.stopped_by is None:
                        self.finish_epoch()
                if self.stopped_by is not None and self.stopped_by != "target":
                    self.save()
                with self.watchdog.waiting("the check that the replicas agree"):
                    replicas_identical = self.strategy.identical(self.comm)   # MPI: the ranks' models agree
        finally:
            self.plan.close()
        return self.result(replicas_identical)

    def train_epoch(self) -> None:
        """Train the rest of the current epoch: steps while the rank has a batch for every learner."""
        cfg, state = self.config, self.state
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
                    state.tally.shuffle_seconds += self.reshuffle()
                if batches is None:
                    batches = self.loader.epoch(state.epoch)
                t0 = time.perf_counter()
                mine = [next(batches) for _ in range(k)]
                waited = time.perf_counter() - t0
                position = state.epoch * self.batches_per_epoch + done   # the schedule counts batches per rank
                place = StepPlace(lr=self.schedule.lr(position), step=state.step,
                                  epoch=position / self.batches_per_epoch, phase=self.schedule.phase(position),
                                  last=self.batches_per_epoch - done - k < k)
                with self.watchdog.waiting(f"the allreduce of step {state.step + 1}"):
                    result = self.strategy.step(mine, place, stop=bool(self.stop), times=StepTimes(data=waited))
                state.step += 1
                if self.strategy.learners != k:   # the auto-tuner added or dropped a learner
                    self.fit_prefetch()
                seconds = time.perf_counter() - t0
                state.tally.add(result, seconds)
                state.train_seconds += seconds
                state.images += int(result.samples)
                self.hooks.on_step(1)
                for event in result.events:
                    self.hooks.on_event(event)
                if not result.finite:
                    raise self.diverged(f"loss {result.loss_sum:.4g}, or a non-finite update")
                if result.stop:   # every rank learnt it from the same allreduce: every rank is here
                    with self.watchdog.waiting("the stop signal's name"):
                        self.stopped_by = first_signal(self.comm.allgather(self.stop.received))   # MPI
                    break
                if result.synced and not place.last and self.eval_due():
                    self.record_evaluation(self.evaluate())   # may reach the target and end the run
                if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and not place.last:
                    self.save()
        except StopIteration:
            raise RuntimeError("the loader ended its epoch before batches_per_epoch batches") from None
        finally:
            if batches is not None:
                batches.close()
        if self.stopped_by is None:
            self.loader.seek(state.epoch + 1)

    def finish_epoch(self) -> None:
        """Evaluate the model, record the epoch, checkpoint."""
        state = self.state
        evaluation = self.evaluate()
        state.epoch += 1
        first = not self.memory
        with self.watchdog.waiting(f"the figures of epoch {state.epoch}"):
            state.history.append(self.epoch_metrics(evaluation))   # MPI: the time split averaged over ranks
            self.memory = gather_rank_memory(self.comm, self.loader.worker_pids)   # MPI: each rank's, the store once
        self.record_evaluation(evaluation)
        state.tally = EpochTally()
        if first:
            self.hooks.on_event(describe_ranks(self.memory))
        self.save()
        self.hooks.on_epoch(state.history[-1])

    # -- checkpoints (dimd.train.checkpoint does the work) ------------------------------------

    def save(self) -> str | None:
        """Collective: rank 0 writes a checkpoint (if the run has a folder); every rank learns its path."""
        with self.watchdog.waiting(f"the checkpoint after step {self.state.step}"):
            path = save_run(self, self.state, last_good=self.last_checkpoint)
        if path is not None:
            self.last_checkpoint = path
        return path

    def resume(self) -> None:
        """Continue from the checkpoint that ``resume``/``resume_from`` name, if there is one."""
        path = self.plan.resume_path
        if path is None:
            return
        with self.watchdog.waiting(f"the resume from {path}"):
            self.state, notes = restore_run(self, path)   # MPI: the store's shuffle replayed
        self.resumed_from = path
        self.hooks.on_event(f"resumed from {path} at epoch {self.state.epoch}, step {self.state.step} "
                            f"(run {self.state.run_id})")
        for note in notes:
            self.hooks.on_event(note)

    # -- the step's helpers -------------------------------------------------------------------

    def shuffle_round(self) -> int:
        """The store round this position should hold.

        Round 0 comes before the first step, whatever ``shuffle_every``: a rank's share in load
        order is a contiguous slice of the pack, which is in class order, and learners (SMA) or
        batch-norm statistics (both) fitted to a few classes are knocked back when the rest arrive.
        """
        every, state = self.config.shuffle_every, self.state
        if every is None:
            return 0
        return state.epoch if every == 0 else state.step // every

    def reshuffle(self) -> float:
        t0 = time.perf_counter()
        self.loader.close()  # no decoder may read the store while records move
        with self.watchdog.waiting(f"the shuffle of round {self.shuffle_round()}"):
            self.store.shuffle(self.config.seed, self.shuffle_round())  # MPI: records move between ranks
        return time.perf_counter() - t0

    def fit_prefetch(self) -> None:
        """Have the loader decode ahead for the strategy's learners (the ring is resized at the next epoch)."""
        self.loader.prefetch = prefetch_for(self.strategy.learners)

    # -- evaluations and records ----------------------------------------------------------------

    def eval_due(self) -> bool:
        return bool(self.eval_every_images) and self.state.images >= self.state.next_eval_images

    def evaluate(self) -> EvalResult:
        """Collective: the model's validation figures, with the weights' moving average's beside them (``ema``),
        both scored on one pass over the validation batches."""
        from mpi4py import MPI

        t0 = time.perf_counter()
        average = self.strategy.average
        models = [self.strategy.eval_model()] + ([average.module] if average is not None else [])
        plan = self.plan
        with plan.precision.autocast():   # one row of counts per model
            counts = local_counts(models, self.val_loader.epoch(0), plan.normalize, label_map=plan.val_label_map,
                                  tta=self.config.tta)
        with self.watchdog.waiting(f"the evaluation's allreduce after step {self.state.step}"):
            self.comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)   # MPI: every rank scored its share
        seconds = time.perf_counter() - t0
        result = summarize(counts[0], seconds)
        if not math.isfinite(result.loss):                        # the same sums on every rank
            raise self.diverged(f"validation loss {result.loss:.4g}")
        if average is not None:
            result = dataclasses.replace(result, ema=summarize(counts[1], seconds))
        return result

    def diverged(self, what: str) -> TrainingDiverged:
        """The one line a diverged run ends with (every rank raises it at the same step)."""
        return TrainingDiverged(f"training diverged at step {self.state.step} ({what}); nothing was saved after "
                                f"it, the last good checkpoint is {self.last_checkpoint or 'none'}; lower `lr`"
                                + (" or `alpha`" if self.config.sync == "sma" else "") + " or add `warmup_epochs`")

    def record_evaluation(self, evaluation: EvalResult) -> None:
        """Note an evaluation (the epoch end's counts as the periodic one that is due) and check the target."""
        state = self.state
        while self.eval_every_images and state.next_eval_images <= state.images:
            state.next_eval_images += self.eval_every_images
        epoch, done = self.loader.position
        ema = evaluation.ema
        record = Evaluation(epoch=epoch + done / self.batches_per_epoch, images=state.images,
                            elapsed=time.perf_counter() - self.started,
                            top1=evaluation.top1, top5=evaluation.top5, loss=evaluation.loss,
                            step=state.step, train_seconds=state.train_seconds,
                            ema_top1=ema.top1 if ema else None, ema_top5=ema.top5 if ema else None,
                            ema_loss=ema.loss if ema else None)
        state.evaluations.append(record)
        best = max(evaluation.top1, ema.top1 if ema else 0.0)   # the average counts: it is what export takes
        if self.target_top1 is not None and best >= self.target_top1 and self.stopped_by is None:
            self.stopped_by = "target"
            self.target_reached = {"top1": 100 * self.target_top1, "reached_top1": 100 * best,
                            "by": "ema" if ema and ema.top1 > evaluation.top1 else "model",
                            "seconds": record.elapsed, "train_seconds": record.train_seconds,
                            "epochs": record.epoch, "updates": record.step, "images": record.images}
            if state.history and done == 0:   # an epoch's end: its --metrics line says so too
                state.history[-1].target = self.target_reached
            self.hooks.on_event(f"validation top-1 {100 * best:.2f}% reaches the target "
                                f"{100 * self.target_top1:.2f}% after {record.epoch:g} epochs, {record.step} "
                                f"updates, {state.images} training images, {record.elapsed:.1f} s")

    def epoch_metrics(self, evaluation: EvalResult) -> EpochMetrics:
        from mpi4py import MPI

        state, tally, ema = self.state, self.state.tally, evaluation.ema
        split = np.array(list(tally.times.as_dict().values()), np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, split, op=MPI.SUM)   # MPI: the time split averaged over ranks
        split /= self.world
        samples = max(tally.samples, 1)
        train_s = tally.train_seconds
        strategy = self.strategy.figures()
        return EpochMetrics(
            epoch=state.epoch, step=state.step,
            lr=self.schedule.lr(max(state.epoch * self.batches_per_epoch - 1, 0)),
            train_loss=tally.loss_sum / samples, train_top1=tally.correct / samples,
            val_loss=evaluation.loss, val_top1=evaluation.top1, val_top5=evaluation.top5,
            images=int(tally.samples), images_per_s=tally.samples / train_s if train_s > 0 else 0.0,
            seconds=train_s + tally.shuffle_seconds + evaluation.seconds, train_seconds=train_s,
            eval_seconds=evaluation.seconds, shuffle_seconds=tally.shuffle_seconds,
            time_split=dict(zip(TIME_SPLIT, split.tolist())),
            elapsed=time.perf_counter() - self.started, sync=self.strategy.name,
            learners_per_rank=self.strategy.learners, alpha=strategy.get("alpha"),
            synchronisations=tally.synchronisations, **{k: strategy[k] for k in NOISE_FIELDS if k in strategy},
            ema_val_loss=ema.loss if ema else None, ema_val_top1=ema.top1 if ema else None,
            ema_val_top5=ema.top5 if ema else None)

    def result(self, replicas_identical: bool) -> TrainResult:
        plan, schedule = self.plan, self.schedule
        figures = self.strategy.figures()
        figures.setdefault("cuda_graphs", {"on": False, "rule": plan.graphs.rule})
        result = TrainResult(
            config=self.config, model=plan.model_info, world_size=self.world, device=str(plan.device),
            allreduce=plan.algorithm, allreduce_choice=plan.algorithm_choice,
            steps_per_epoch=self.steps_per_epoch, global_batch=self.global_batch, lr_batch=plan.lr_batch,
            schedule={"kind": schedule.kind, "peak_lr": schedule.peak_lr,
                      "warmup_steps": schedule.warmup_steps, "milestones": list(schedule.milestones),
                      "total_steps": schedule.total_steps, "counts": "batches per rank"},
            sync=self.strategy.name, strategy={k: v for k, v in figures.items() if k != "learners_per_rank"},
            epochs=self.state.history, evaluations=self.state.evaluations, resumed_from=self.resumed_from,
            stopped_by=self.stopped_by, checkpoint=self.last_checkpoint, threads=plan.threads,
            decode_workers=plan.decode_workers, run_id=self.state.run_id, memory=self.memory)
        if self.target_top1 is not None:
            result.target = {"top1": 100 * self.target_top1, "reached": self.target_reached is not None,
                             **(self.target_reached or {})}
        result.replicas_identical = replicas_identical
        result.seconds = time.perf_counter() - self.started
        return result


def train(config: TrainConfig, comm, **options: Any) -> TrainResult:
    """Run ``config`` on every rank of ``comm``; see :class:`Trainer`."""
    return Trainer(config, comm, **options).run()
