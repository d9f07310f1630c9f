"""The training runs behind ``plan-batch convergence``: every (global batch, seed), to a target top-1.

Each run is an ordinary run of the training engine (:class:`dimd.train.engine.Trainer`,
S-SGD), evaluated every fixed number of training images and stopped at the
first evaluation that reaches the target, or when its budget of epochs runs
out. Its updates to the target are the steps taken at that evaluation
(:func:`dimd.train.plan.convergence.first_reached`); a run that diverges or
runs out of budget is kept as "not reached", with the reason.

How the runs map onto the job's P ranks: the ranks split into P / G groups
of G consecutive ranks (``ranks_per_run``, default 1); each group trains one
run at a time as a sub-communicator, with M / G images per rank, and asks
for the next when it is done. Why one rank per run by default: the runs are
independent, so P of them at once keeps every rank computing and none
waiting in an allreduce (the fastest way through the sweep); N_update(M) is
a property of the global batch, not of how it is spread (Perrone et al.;
exactly so for models without batch norm); and the result does not depend
on how many ranks measured it. G > 1 is for a batch that does not fit one
device, or to measure runs exactly as they will be trained.

Why handed out as the groups ask (rank 0 keeps the list; the groups' first
ranks ask it for the next run when they finish one): a run's cost is not
known in advance. A run that reaches the target costs about N_inf M + alpha
images but N_inf + alpha/M steps (each with a fixed overhead), one that
does not costs its whole budget, one that diverges almost nothing; a fixed
assignment that guessed (largest M first, dealt in a snake) left one of two
ranks idle for two thirds of a measured sweep. Rank 0 answers between its
own training steps (an ``on_step`` hook: a non-blocking probe, microseconds),
so no rank is set aside to dispatch. The list still starts with the largest
batches, the longest runs when they reach the target, so that a long run
does not start last. Every wait (for an answer, for the others at the end)
polls with short sleeps instead of spinning in MPI, so a waiting rank leaves
its core to the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dimd.errors import DimdError
from dimd.mpi import agree_or_raise, agreed
from dimd.shuffle.store import packed_record_count
from dimd.train.plan.config import ConvergenceConfig
from dimd.train.plan.convergence import Run, convergence_figures, first_reached, unfitted_figures

#: The training set's share between evaluations by default (``eval_every_images`` None).
DEFAULT_EVALUATIONS_PER_EPOCH = 10


@dataclass(frozen=True)
class RunSpec:
    batch: int     # global batch M
    seed: int


@dataclass
class RunRecord:
    """One finished run, as its group's first rank saw it."""

    batch: int
    seed: int
    group: int                          # which group of ranks trained it
    ranks: int                          # G
    reached: bool
    updates: int | None                 # at the first evaluation that reached the target
    budget: int                         # the updates it was allowed (max_epochs x steps per epoch)
    reason: str | None                  # why not reached: "budget" or "diverged at step N"
    lr: float                           # the peak rate after linear scaling
    warmup_steps: int
    steps_per_epoch: int
    images_to_target: int | None
    train_seconds_to_target: float | None   # in training steps only (no loading, evaluation, shuffles)
    elapsed_to_target: float | None         # since the run started, evaluations and loading included
    steps: int                          # taken in all
    seconds: float                      # the whole run, loading included
    final_top1: float | None
    evaluations: list[list[float]] = field(default_factory=list)   # [step, top-1, training seconds]
    #: Seconds per rank over the whole run (to the target, when reached) in data waits, compute, the allreduce,
    #: the optimizer: where a step's time went, beside T_update = Gamma + Delta's prediction.
    time_split: dict[str, float] = field(default_factory=dict)
    classes: int = 0                    # the model's outputs (chance top-1 is 1 / classes)
    optimizer: str = "sgd"              # what trained it (dimd.train.optimizers.optimizer_name)

    def as_run(self) -> Run:
        return Run(self.batch, self.seed, self.updates, None if self.reached else self.budget,
                   None if self.reached else self.reason, self.optimizer)


@dataclass
class ConvergenceRuns:
    """Every run of the sweep (on rank 0; the other ranks hold their own group's only)."""

    records: list[RunRecord]
    groups: int
    ranks_per_run: int
    eval_every_images: int
    threads: int
    device: str
    training_images: int
    group_seconds: list[float]          # each group's time through its share (rank 0's list holds all)

    def runs(self) -> list[Run]:
        return [r.as_run() for r in self.records]

    def figures(self, target: float) -> tuple[dict[str, Any], str | None]:
        """The ``plan-batch convergence`` figures (rank 0), and why the inverse law could not be fitted, if so.

        A sweep that cannot be fitted still reports every run, so nothing trained is lost.
        """
        problem = None
        try:
            figures = convergence_figures(self.runs(), target)
        except DimdError as exc:
            problem = str(exc)
            figures = unfitted_figures(self.runs(), target, problem)
        for row in figures["batches"]:
            times = sorted(r.train_seconds_to_target for r in self.records
                           if r.batch == row["batch"] and r.train_seconds_to_target is not None)
            row["lr"] = next((r.lr for r in self.records if r.batch == row["batch"]), None)
            row["train_seconds_median"] = times[len(times) // 2] if times else None
        figures.update({"runs": self.records, "eval_every_images": self.eval_every_images,
                        "training_images": self.training_images, "ranks_per_run": self.ranks_per_run,
                        "groups": self.groups, "group_seconds": self.group_seconds, "threads": self.threads,
                        "device": self.device, "classes": self.records[0].classes if self.records else None,
                        "lr": {str(r.batch): r.lr for r in self.records},
                        "schedule": "linear scaling of --lr by M/256, warm-up as dimd train, then constant"})
        return figures, problem


def run_order(config: ConvergenceConfig) -> list[RunSpec]:
    """Every (batch, seed) of the sweep, in the order they are handed out: largest batch first."""
    return [RunSpec(m, s) for m in sorted(set(config.batch_sizes), reverse=True) for s in config.run_seeds]


#: Message tags of the hand-out: a group's first rank asks rank 0, rank 0 answers with a run's index or -1.
ASK, ANSWER = 7301, 7302
POLL_S = 0.002


def wait_for(request: Any) -> Any:
    """Complete a non-blocking MPI request, sleeping between tests (no spinning on a shared core)."""
    while True:
        done, value = request.test()
        if done:
            return value
        time.sleep(POLL_S)


class Dispatcher:
    """Rank 0's side of the hand-out: the next run's index to whoever asks, then -1 to each asker."""

    def __init__(self, comm: Any, runs: int, askers: int) -> None:
        self.comm = comm
        self.runs = runs
        self.next = 0
        self.askers = askers        # the other groups' first ranks
        self.finished = 0           # askers told there is nothing left

    def take(self) -> int:
        if self.next >= self.runs:
            return -1
        self.next += 1
        return self.next - 1

    def serve(self, *_: Any) -> None:
        """Answer every question waiting now (the ``on_step`` hook: a probe when there are none)."""
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=ASK, status=status):
            source = status.Get_source()
            self.comm.recv(source=source, tag=ASK)
            index = self.take()
            self.finished += index < 0
            self.comm.send(index, dest=source, tag=ANSWER)   # MPI: the asker's next run

    def finish(self) -> None:
        """After rank 0's last run: tell every asker still running that nothing is left."""
        while self.finished < self.askers:
            self.serve()
            time.sleep(POLL_S)


def next_run(comm: Any, sub: Any, dispatcher: Dispatcher | None) -> int:
    """Collective over the group's ``sub``: the index of its next run, -1 when none is left."""
    index = -1
    if dispatcher is not None:          # world rank 0 serves itself
        index = dispatcher.take()
    elif sub.Get_rank() == 0:           # a group's first rank asks rank 0
        comm.send(None, dest=0, tag=ASK)
        index = wait_for(comm.irecv(source=0, tag=ANSWER))
    if sub.Get_size() > 1:
        wait_for(sub.Ibarrier())         # MPI: the group waits for its first rank's answer without spinning
        index = sub.bcast(index, root=0)
    return int(index)


def _other_classes(config: ConvergenceConfig) -> str | None:
    """Why VAL is no validation set of TRAIN (classes TRAIN does not have), or None.

    Each group's engine would find it only as its first run starts, on its group alone, and abort the job.
    """
    from dimd.format import PackedDataset
    from dimd.train.run_plan import val_label_map

    try:
        val_label_map(list(PackedDataset(config.train).classes), list(PackedDataset(config.val).classes),
                      config.val, config.train)
    except DimdError as exc:
        return str(exc)
    return None


def run_convergence(config: ConvergenceConfig, comm: Any, *,
                    on_run: Callable[[RunRecord, int, int], None] | None = None) -> ConvergenceRuns:
    """Collective over ``comm``: train every run of ``config``; the records gathered on rank 0.

    ``on_run(record, number, runs)`` is called on each group's first rank after
    each of its runs (the run's ``number`` in the hand-out order, of ``runs``).
    """
    from dimd.train.hardware import default_threads, pick_device

    size, rank = comm.Get_size(), comm.Get_rank()
    g = config.ranks_per_run
    if size % g:   # every rank knows: the job ends in order
        raise agreed(comm, f"`ranks_per_run` {g} does not divide the job's {size} rank(s): run under "
                           f"mpirun -n with a multiple of {g}")
    groups = size // g
    total = packed_record_count(comm, config.train, config.val)   # MPI: rank 0 read it for every rank
    if max(config.batch_sizes) > total:
        raise agreed(comm, f"`batch_sizes`: {max(config.batch_sizes)} is more than the {total} records of "
                           f"{config.train}: every batch must fit in the training set")
    agree_or_raise(comm, _other_classes(config) if rank == 0 else None)   # MPI: before any group loads
    every = config.eval_every_images or max(1, total // DEFAULT_EVALUATIONS_PER_EPOCH)
    # MPI: the node's cores are shared by all the job's ranks, whatever group they train in
    threads = config.threads or default_threads(comm)
    device = pick_device(config.train_config(min(config.batch_sizes), config.first_seed).device, comm)
    group = rank // g
    order = run_order(config)
    dispatcher = Dispatcher(comm, len(order), groups - 1) if rank == 0 else None
    serve = dispatcher.serve if dispatcher is not None else None
    sub = comm.Split(group, rank)   # MPI: this rank's group trains its runs on its own
    mine: list[RunRecord] = []
    started = time.perf_counter()
    try:
        while (index := next_run(comm, sub, dispatcher)) >= 0:
            record = train_one(config, order[index], sub, group, threads, every, device, on_step=serve)
            if sub.Get_rank() == 0:
                mine.append(record)
                if on_run is not None:
                    on_run(record, index + 1, len(order))
        if dispatcher is not None:
            dispatcher.finish()
    finally:
        sub.Free()
    busy = time.perf_counter() - started
    wait_for(comm.Ibarrier())   # MPI: the others' last runs, waited for without spinning
    leader = rank % g == 0
    gathered = comm.gather((mine, busy if leader else None), root=0)   # MPI: every group's records, on rank 0
    if gathered is None:
        return ConvergenceRuns(mine, groups, g, every, threads, str(device), total, [busy])
    records = sorted((r for part, _ in gathered for r in part), key=lambda r: (r.batch, r.seed))
    seconds = [s for _, s in gathered if s is not None]
    return ConvergenceRuns(records, groups, g, every, threads, str(device), total, seconds)


def train_one(config: ConvergenceConfig, spec: RunSpec, comm: Any, group: int, threads: int,
              eval_every_images: int, device: Any, on_step: Callable[..., None] | None = None) -> RunRecord:
    """Collective over the group's ``comm``: one run, to the target or to the end of its budget."""
    from dimd.train.engine import Hooks, Trainer, TrainingDiverged
    from dimd.train.optimizers import optimizer_name

    train_config = config.train_config(spec.batch, spec.seed, threads)
    started = time.perf_counter()
    trainer = Trainer(train_config, comm, eval_every_images=eval_every_images,
                      target_top1=config.target_top1, device=device,
                      hooks=Hooks(on_step=on_step) if on_step is not None else None)
    budget = trainer.batches_per_epoch * config.max_epochs
    reason: str | None = None
    try:
        result = trainer.run()
    except TrainingDiverged:
        reason = f"diverged at step {trainer.state.step}"
        evaluations = trainer.state.evaluations
    else:
        if result.stopped_by not in (None, "target"):   # a stop signal: ends the sweep as it does between runs
            import signal

            from dimd.signals import Terminated

            raise Terminated(signal.Signals[result.stopped_by])
        evaluations = result.evaluations
    updates = first_reached([(e.step, e.top1) for e in evaluations], config.target_top1)
    hit = next((e for e in evaluations if e.top1 >= config.target_top1), None)   # that same evaluation
    if updates is None and reason is None:
        reason = "budget"
    schedule = trainer.schedule
    # finished epochs (averaged over the group's ranks) and the epoch under way when it stopped (this rank's)
    split = {k: sum(e.time_split.get(k, 0.0) for e in trainer.state.history) + v
             for k, v in trainer.state.tally.times.as_dict().items()}
    return RunRecord(
        batch=spec.batch, seed=spec.seed, group=group, ranks=comm.Get_size(), reached=updates is not None,
        updates=updates, budget=budget, reason=reason, lr=schedule.peak_lr, warmup_steps=schedule.warmup_steps,
        steps_per_epoch=trainer.batches_per_epoch, images_to_target=hit.images if hit else None,
        train_seconds_to_target=hit.train_seconds if hit else None, elapsed_to_target=hit.elapsed if hit else None,
        steps=trainer.state.step, seconds=time.perf_counter() - started,
        final_top1=evaluations[-1].top1 if evaluations else None,
        evaluations=[[e.step, e.top1, round(e.train_seconds, 4)] for e in evaluations],
        time_split={k: round(v, 4) for k, v in split.items()}, classes=len(trainer.store.classes),
        optimizer=optimizer_name(trainer.strategy.optimizer))   # type: ignore[attr-defined]  # S-SGD's, one
