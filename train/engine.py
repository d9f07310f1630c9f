"""The training engine: S-SGD (DIMD paper, sections 3 and 5) and SMA (Crossbow, section 3) in one loop.

Collective over ``comm``: every rank loads its share of the packed training
and validation sets into memory (:class:`dimd.shuffle.DistributedStore`) and
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

This module is set-up (:class:`Trainer`'s constructor, from top to bottom:
hardware, data, model and strategy, schedule) and the loop (:meth:`Trainer.run`,
:meth:`Trainer.train_epoch`, :meth:`Trainer.finish_epoch`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

import numpy as np
import torch

from dimd.allreduce import device_group
from dimd.errors import DimdError
from dimd.mpi import agree_or_raise, agreed
from dimd.shuffle.memory import describe_ranks, gather_rank_memory
from dimd.stall import watch_job
from dimd.train.checkpoint import RunState, restore_run, resume_point, save_run
from dimd.train.config import TrainConfig
from dimd.train.evaluate import EvalResult, local_counts, summarize
from dimd.train.flatgrad import Reduce
from dimd.train.hardware import default_decode_workers, pick_device, set_threads
from dimd.train.model_source import recorded_source
from dimd.train.models import build_model, gradient_bytes, model_problem, parameter_count
from dimd.train.precision import Precision, memory_format
from dimd.train.results import NOISE_FIELDS, EpochMetrics, EpochTally, Evaluation, TrainResult
from dimd.train.schedule import Schedule, make_schedule
from dimd.train.signals import StopRequest, first_signal, stop_request
from dimd.train.steps import TIME_SPLIT, StepPlace, StepTimes, Strategy


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


# -- set-up -----------------------------------------------------------------------------------


def check_before_loading(config: TrainConfig, comm: Any) -> None:
    """Collective: the checks that need the job but not the data, one clear line before minutes of loading.

    The model is named and, for a user's, its file or module imported, but not built: a builder may
    refuse any class count but the data's, which the load learns. Agreed, so a file some nodes lack
    stops every rank in order.
    """
    if config.noise_scale and comm.Get_size() < 2:
        raise DimdError("`noise_scale` needs at least 2 ranks: it compares each rank's gradient with their "
                        "average (run under mpirun -n 2 or more)")
    agree_or_raise(comm, model_problem(config.model))   # MPI: one rank's import error stops every rank


def build_agreed(config: TrainConfig, num_classes: int, comm: Any) -> torch.nn.Module:
    """Collective: ``config.model`` for ``num_classes``; a builder that raises on any rank stops every rank."""
    model, problem = None, None
    try:
        model = build_model(config.model, num_classes, zero_init_residual=config.zero_init_residual)
    except DimdError as exc:   # a user's builder: every rank calls it alike
        problem = str(exc)
    agree_or_raise(comm, problem)   # MPI: every rank builds
    assert model is not None
    return model


def check_inputs_before_loading(config: TrainConfig, comm: Any) -> str | None:
    """Collective: the training set's size for one batch per rank (from its index) and the checkpoint to resume
    from, each named in one line before the load (which the loader and the resume would only find after it).
    Returns the checkpoint to resume from, if any."""
    from dimd.shuffle.loader import too_few_for_a_batch
    from dimd.shuffle.store import packed_record_count

    records = packed_record_count(comm, config.train)   # MPI: rank 0 read the index for every rank
    problem = too_few_for_a_batch(f"{config.train}.dimd", records, comm.Get_size(), config.batch_size)
    if problem:
        raise agreed(comm, problem)
    return resume_point(config, comm)   # MPI: a checkpoint that is named but missing stops every rank


def check_decode(config: TrainConfig, device: torch.device, comm: Any) -> None:
    """Collective: ``decode`` gpu stops every rank with one line, before the data loads, where it cannot run on
    some rank (no CUDA, no torchvision): agreed, since each rank sees only its own device and libraries."""
    if config.decode == "gpu":
        from dimd.shuffle.gpu_decode import gpu_decode_problem

        problem = gpu_decode_problem() if device.type == "cuda" else "decode gpu needs `device` cuda"
        agree_or_raise(comm, problem)   # MPI: every rank asks, as every rank has the same config


def check_device_allreduce(config: TrainConfig, device: torch.device, comm: Any) -> None:
    """Collective: ``allreduce`` nccl or gloo stops every rank with one line, before the data loads, where this
    job cannot run it (a rank on the CPU or without NCCL, ranks sharing a GPU); the group starts after the load."""
    from dimd.allreduce import BACKENDS, get_algorithm, group_problem
    from dimd.allreduce.torchdist import process_group_ready

    backend = get_algorithm(config.allreduce).torch_group if config.allreduce else None
    if backend in BACKENDS:
        agree_or_raise(comm, group_problem(comm, backend, device))   # MPI: every rank's GPU and torch build
    elif backend is not None:   # torch: the group a script of the caller's started
        problem = None
        try:
            process_group_ready()
        except DimdError as exc:
            problem = str(exc)
        agree_or_raise(comm, problem)


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


def make_loaders(config: TrainConfig, store: Any, val_store: Any, device: torch.device,
                 workers: int) -> tuple[Any, Any]:
    """The training loader (over the store, or over the original files with ``read_from``) and the validation one."""
    from dimd.shuffle import BatchLoader

    pin = device.type == "cuda"
    source: Any = store
    if config.read_from != "memory":
        from dimd.shuffle.filesource import OriginalFiles

        source = OriginalFiles(store, config.files_root, cold=config.read_from == "files-cold")
    loader = BatchLoader(source, config.batch_size, config.image_size, train=True, decode_workers=workers,
                         seed=config.seed, pin_memory=pin, crop_scale=config.crop_scale)
    val_loader = BatchLoader(val_store, config.eval_batch_size or config.batch_size, config.image_size,
                             train=False, decode_workers=workers, seed=config.seed, pin_memory=pin)
    from dimd.shuffle.device_feed import device_feed

    # The batches reach the device one step ahead, on a copy stream (decoded there with decode gpu).
    return device_feed(loader, device, config.decode), device_feed(val_loader, device, config.decode)


def prefetch_for(learners: int) -> int:
    """Batches decoded ahead: a step takes one per learner, and two steps' worth keep the workers busy."""
    return max(2, 2 * learners)


def loaders_memory(config: TrainConfig, workers: int) -> int:
    """Bytes the training and validation loaders' batches need at least (the load's memory check counts them)."""
    from dimd.shuffle.memory import batch_memory

    slots = 1 + prefetch_for(config.sma.fixed_learners)   # the ring holds prefetch + 1 batches
    return (batch_memory(config.batch_size, config.image_size, slots, workers)
            + batch_memory(config.eval_batch_size or config.batch_size, config.image_size, 3, 0))


def calibration_source(config: TrainConfig, store: Any, device: torch.device, workers: int) -> Any:
    """Training batches for SMA's batch-norm recompute, from a loader of their own (seed + 1) that
    shares the training loader's workers, so the training loader's position and batches stay as they are."""
    from dimd.shuffle import BatchLoader
    from dimd.train.batchnorm import CalibrationBatches

    batch = min(config.eval_batch_size or config.batch_size, store.total // store.comm.Get_size())
    return CalibrationBatches(BatchLoader(store, batch, config.image_size,
                                          train=True, decode_workers=workers, seed=config.seed + 1,
                                          pin_memory=device.type == "cuda", crop_scale=config.crop_scale))


def choose_allreduce(config: TrainConfig, nbytes: int, comm, device: torch.device) -> tuple[str, dict[str, Any]]:
    """Collective: the requested algorithm; or on GPUs nccl, where every rank has a GPU of its own and NCCL;
    else the fastest measured now for this message size. Also how it was chosen, and why not nccl."""
    if config.allreduce is not None:  # TrainConfig checked the name
        return config.allreduce, {"how": "requested"}
    if comm.Get_size() == 1:
        return "mpi", {"how": "single rank"}
    choice: dict[str, Any] = {}
    if device.type == "cuda":
        from dimd.allreduce import group_problem

        choice["not_nccl"] = group_problem(comm, "nccl", device)   # MPI: every rank's GPU and torch build
        if choice["not_nccl"] is None:
            return "nccl", {"how": "the default on GPUs: every rank has a GPU of its own and NCCL is available"}
    from dimd.allreduce import choose_fastest

    return choose_fastest(nbytes, comm, np.float32), {"how": "fastest measured at start-up", "bytes": nbytes,
                                                       **choice}


def overlap_choice(config: TrainConfig, device: torch.device, comm: Any, graphs: bool = False) -> bool:
    """``overlap``, or where unset: S-SGD on several ranks with a core or GPU free for the communication,
    unless the step runs as CUDA graphs (which cannot capture the communication thread)."""
    if config.overlap is not None:
        return config.overlap
    from dimd.train.buckets import core_free_for_communication

    free = core_free_for_communication(device, comm)   # MPI: collective (the node's ranks)
    return config.sync == "ssgd" and not config.noise_scale and comm.Get_size() > 1 and free and not graphs


@dataclass(frozen=True)
class GraphChoice:
    """Whether the step replays as CUDA graphs, why (for the JSON), and where (None: the device's own)."""

    on: bool
    rule: str
    backend: Any = None


def graphs_choice(config: TrainConfig, device: torch.device, model: torch.nn.Module, comm: Any,
                  backend: Any = None) -> GraphChoice:
    """Collective: ``cuda_graphs``, or where unset the rule of :func:`dimd.train.graphs.graphs_rule`.

    Every rank has the same config, model and kind of device, so every rank decides alike; an explicit
    ``cuda_graphs`` the run cannot honour stops every rank with one line. ``backend``: a stand-in
    for the GPU (tests run the graphed steps on the CPU with :class:`~dimd.train.graphs.StandIn`). The
    device was checked before the load (:func:`check_graphs_device`).
    """
    from dimd.train.graphs import capture_problem, graphs_rule

    if backend is not None:
        return GraphChoice(True, f"on: {backend.name} backend given to the trainer", backend)
    problem = capture_problem(model)
    if config.cuda_graphs:
        agree_or_raise(comm, problem and f"{problem}: give it a momentum, or leave out `cuda_graphs`")  # MPI: one model
    on, rule = graphs_rule(config.cuda_graphs, device, config.batch_size, config.image_size,
                           overlap=config.overlap, learner_compute=config.sma.learner_compute)
    if on and problem:
        on, rule = False, f"off: {problem}"
    if config.sync == "sma" and config.sma.learner_compute == "branches" and not on:
        agree_or_raise(comm, f"`learner_compute` branches is one CUDA graph with a branch per learner, but graphs "
                             f"are {rule}")
    return GraphChoice(on, rule)


def check_graphs_device(config: TrainConfig, device: torch.device, comm: Any) -> None:
    """Collective: ``cuda_graphs`` on a run whose device is the CPU stops every rank with one line, before
    the data loads (``device`` auto found no GPU; ``device`` cpu is refused by the config)."""
    if config.cuda_graphs and device.type != "cuda":
        agree_or_raise(comm, "`cuda_graphs` replays the step's CUDA work, and this run's device is the CPU (no "
                             "CUDA device here); leave it out")   # MPI: the device kind is agreed


def make_reducer(algorithm: str, comm) -> Reduce:
    from dimd.allreduce import allreduce

    def reduce(array: np.ndarray) -> None:
        allreduce(array, comm, algorithm)   # MPI: sum over the ranks

    return reduce


def make_strategy(config: TrainConfig, model: torch.nn.Module, reduce: Reduce,
                  world_size: int, normalize: Any, batches_per_epoch: int, overlap: bool = False,
                  calibration: Callable[[int, int], Iterator[Any]] | None = None,
                  precision: Any = None, graphs: GraphChoice | None = None,
                  device_reduce: Any = None) -> Strategy:
    """S-SGD or SMA over ``model`` (which SMA makes its central model z), as ``config.sync`` says;
    ``overlap``: S-SGD reduces gradient buckets during backward; ``calibration``: the training
    batches SMA recomputes z's batch-norm statistics on; ``graphs``: the steps replay as CUDA graphs;
    ``device_reduce``: the torch.distributed group that reduces the gradients (S-SGD) or Delta (SMA) in
    place on the device, instead of ``reduce`` (graphed: between the step's graphs)."""
    cfg = config
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    graphed = graphs is not None and graphs.on
    if cfg.sync == "sma":
        from dimd.train.sma import SMA

        sma = cfg.sma
        sma_class: Any = SMA
        extra: dict[str, Any] = {}
        if graphed:
            from dimd.train.graphed_sma import GraphedSMA

            assert graphs is not None
            sma_class, extra = GraphedSMA, {"backend": graphs.backend, "rule": graphs.rule,
                                            "fallback": cfg.cuda_graphs is None}
        return sma_class(model, reduce, world_size, learners=None if sma.autotune else sma.fixed_learners,
                         alpha=sma.alpha, momentum=cfg.momentum, central_momentum=sma.sma_momentum,
                         weight_decay=cfg.weight_decay, decay_bn_and_bias=cfg.decay_bn_and_bias,
                         sync_every=sma.sync_every, compute=sma.learner_compute,
                         normalize=normalize, threads=torch.get_num_threads(),
                         autotune_threshold=sma.autotune_threshold,
                         max_learners=batches_per_epoch, synchronize=sync, calibration=calibration,
                         device_reduce=device_reduce, **extra)
    from dimd.train.sgd import SSGD, make_optimizer

    optimizer = make_optimizer(model, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
                               decay_bn_and_bias=cfg.decay_bn_and_bias)
    noise = None
    if cfg.noise_scale:
        from dimd.train.noise import NoiseScale

        noise = NoiseScale()
    if graphed:
        from dimd.train.graphed_sgd import GraphedSSGD

        assert graphs is not None
        return GraphedSSGD(model, optimizer, reduce, world_size, backend=graphs.backend,
                           bucket_bytes=cfg.bucket_bytes(False), normalize=normalize, noise=noise,
                           precision=precision, rule=graphs.rule, device_reduce=device_reduce,
                           fallback=cfg.cuda_graphs is None)
    return SSGD(model, optimizer, reduce, world_size, bucket_bytes=cfg.bucket_bytes(overlap),
                normalize=normalize, noise=noise, overlap=overlap, precision=precision,
                device_reduce=device_reduce)


# -- the run ----------------------------------------------------------------------------------


class Trainer:
    """One training run: the constructor sets it up (collective over ``comm``), :meth:`run` trains.

    ``eval_every_images`` adds an evaluation whenever that many more training
    images (all ranks) have been processed; ``target_top1`` ends the run
    (``stopped_by == "target"``) at the first evaluation that reaches it.
    ``device`` overrides ``config.device`` (``plan-batch convergence`` picks
    each rank's GPU on the whole job, then trains on a sub-communicator).
    ``stop``: the stop signals' flag; the caller enters it before this set-up,
    so that a signal during loading is not lost, or :meth:`run` takes the
    process-wide one (:func:`~dimd.train.signals.stop_request`).
    ``graph_backend``: replay the steps as graphs there (tests: :class:`~dimd.train.graphs.StandIn` on the CPU).
    """

    def __init__(self, config: TrainConfig, comm, *, stop: StopRequest | None = None, hooks: Hooks | None = None,
                 eval_every_images: int | None = None, target_top1: float | None = None,
                 device: torch.device | None = None, graph_backend: Any = None) -> None:
        from dimd.shuffle import DistributedStore
        from dimd.shuffle.normalize import Normalize
        from dimd.train.sgd import broadcast_state

        self.started = time.perf_counter()
        self.memory: list[dict[str, int]] = []   # each rank's memory at the last epoch's end (dimd.shuffle.memory)
        self.config = cfg = config
        self.comm, self.rank, self.world = comm, comm.Get_rank(), comm.Get_size()
        check_before_loading(cfg, comm)
        self.stop = stop if stop is not None else StopRequest()
        self._own_stop = stop is None
        self.hooks = hooks or Hooks()
        self.eval_every_images, self.target_top1 = eval_every_images, target_top1
        # MPI: a wait for the other ranks that outlasts `stall_timeout` (a peer's host is gone) ends the job
        self.watchdog = watch_job(comm, cfg.stall_timeout)

        # -- hardware: threads and device
        self.threads, warning = set_threads(cfg.threads, comm)   # MPI: the node's cores are shared by its ranks
        if warning:
            self.hooks.on_event(f"note: {warning}")
        self.device = device if device is not None else pick_device(cfg.device, comm)
        check_decode(cfg, self.device, comm)
        if graph_backend is None:
            check_graphs_device(cfg, self.device, comm)
        check_device_allreduce(cfg, self.device, comm)
        self.resume_path = check_inputs_before_loading(cfg, comm)

        # -- data: each rank's share in memory, and the loaders over it
        t0 = time.perf_counter()
        self.decode_workers = workers = cfg.decode_workers or default_decode_workers(comm)   # MPI: the node's cores
        self.store = DistributedStore.load(cfg.train, comm, groups=cfg.groups, memory_limit=cfg.memory_limit,
                                           decode_workers=workers, batch_bytes=loaders_memory(cfg, workers))
        self.val_store = DistributedStore.load(cfg.val, comm, groups=1, memory_limit=cfg.memory_limit)
        try:
            self.val_label_map = val_label_map(self.store.classes, self.val_store.classes, cfg.val, cfg.train)
        except DimdError as exc:   # every rank read the same two indexes
            raise agreed(comm, str(exc)) from None
        self.hooks.on_event(f"loaded {self.store.total} training and {self.val_store.total} validation records "
                            f"into memory in {time.perf_counter() - t0:.1f}s")
        self.loader, self.val_loader = make_loaders(cfg, self.store, self.val_store, self.device, workers)
        #: Batches of ``batch_size`` per rank per epoch; the schedule counts these, so its
        #: position is the same whatever the learners per rank.
        self.batches_per_epoch = self.loader.steps_per_epoch
        learners = cfg.sma.fixed_learners
        if learners > self.batches_per_epoch:   # not one step per epoch: nothing would train
            raise DimdError(f"`learners` {learners} per rank take {learners} batches per step, but a rank has "
                            f"{self.batches_per_epoch} batches of {cfg.batch_size} per epoch: lower `learners` "
                            f"to at most {self.batches_per_epoch}, or `batch_size`")

        # -- model and synchronisation
        torch.manual_seed(cfg.seed)
        self.model = build_agreed(cfg, len(self.store.classes), comm)
        self.memory_format = memory_format(cfg.channels_last if cfg.sync == "ssgd" else False, self.device,
                                           self.model)
        self.model.to(self.device, memory_format=self.memory_format)  # type: ignore[call-overload]  # torch's stub lacks it
        self.precision = Precision(cfg.precision, self.device)
        broadcast_state(self.model, comm)   # MPI: every rank starts from rank 0's weights
        self.normalize = Normalize(self.device, self.memory_format)
        nbytes = gradient_bytes(self.model)
        self.model_info = {"name": cfg.model, "parameters": parameter_count(self.model),
                           "gradient_bytes": nbytes, "classes": len(self.store.classes), **recorded_source(cfg.model)}
        # MPI: the allreduce algorithm, measured for this message size if not given
        self.algorithm, self.algorithm_choice = choose_allreduce(cfg, nbytes, comm, self.device)
        self.graphs = graphs_choice(cfg, self.device, self.model, comm, graph_backend)   # MPI: agreed
        self.overlap = overlap_choice(cfg, self.device, comm, self.graphs.on)
        self.algorithm_choice["overlap"] = self.overlap
        #: nccl, gloo: torch.distributed's group, started from MPI (the rendezvous within the stall timeout)
        self.group = device_group(self.algorithm, comm, self.device, stall_timeout=cfg.stall_timeout)
        try:
            self.calibration = (calibration_source(cfg, self.store, self.device, workers) if cfg.sync == "sma"
                                else None)
            self.strategy: Strategy = make_strategy(cfg, self.model, make_reducer(self.algorithm, comm), self.world,
                                                    self.normalize, self.batches_per_epoch, self.overlap,
                                                    self.calibration, self.precision, self.graphs,
                                                    self.group)
        except BaseException:   # the group ends with the run; a set-up that fails ends it now
            if self.group is not None:
                self.group.close()
            raise
        self.fit_prefetch()

        # -- schedule
        #: The batch ``--lr`` is scaled by (linear scaling, lr x batch / 256): S-SGD's global batch
        #: per step; under SMA a learner's own batch, since every learner steps on its own.
        self.lr_batch = cfg.batch_size * self.world if cfg.sync == "ssgd" else cfg.batch_size
        self.schedule: Schedule = make_schedule(
            cfg.schedule, cfg.lr, global_batch=self.lr_batch,  # type: ignore[arg-type]  # TrainConfig checked it
            steps_per_epoch=self.batches_per_epoch, epochs=cfg.epochs, scaling=cfg.lr_scaling,
            warmup_epochs=cfg.warmup_epochs, milestones=cfg.milestones, power=cfg.power)

        # -- where the run stands (a checkpoint restores it) and how it ended
        self.state = RunState(next_eval_images=eval_every_images or 0)
        self.stopped_by: str | None = None       # the signal (or "target") that ended the run early
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
            self.loader.close()
            self.val_loader.close()
            if self.calibration is not None:
                self.calibration.close()
            self.strategy.close()
            if self.group is not None:
                self.group.close()
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
        path = self.resume_path
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
        from mpi4py import MPI

        t0 = time.perf_counter()
        model = self.strategy.eval_model()
        with self.precision.autocast():
            counts = local_counts(model, self.val_loader.epoch(0), self.normalize, label_map=self.val_label_map)
        with self.watchdog.waiting(f"the evaluation's allreduce after step {self.state.step}"):
            self.comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)   # MPI: every rank scored its share
        result = summarize(counts, time.perf_counter() - t0)
        if not math.isfinite(result.loss):                        # the same sums on every rank
            raise self.diverged(f"validation loss {result.loss:.4g}")
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
        state.evaluations.append(Evaluation(epoch=epoch + done / self.batches_per_epoch, images=state.images,
                                            elapsed=time.perf_counter() - self.started,
                                            top1=evaluation.top1, top5=evaluation.top5, loss=evaluation.loss,
                                            step=state.step, train_seconds=state.train_seconds))
        if self.target_top1 is not None and evaluation.top1 >= self.target_top1 and self.stopped_by is None:
            self.stopped_by = "target"
            self.hooks.on_event(f"validation top-1 {100 * evaluation.top1:.2f}% reaches the target "
                                f"{100 * self.target_top1:.2f}% after {state.images} training images")

    def epoch_metrics(self, evaluation: EvalResult) -> EpochMetrics:
        from mpi4py import MPI

        state, tally = self.state, self.state.tally
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
            synchronisations=tally.synchronisations, **{k: strategy[k] for k in NOISE_FIELDS if k in strategy})

    def result(self, replicas_identical: bool) -> TrainResult:
        figures = self.strategy.figures()
        figures.setdefault("cuda_graphs", {"on": False, "rule": self.graphs.rule})
        schedule = self.schedule
        result = TrainResult(
            config=self.config, model=self.model_info, world_size=self.world, device=str(self.device),
            allreduce=self.algorithm, allreduce_choice=self.algorithm_choice,
            steps_per_epoch=self.steps_per_epoch, global_batch=self.global_batch,
            lr_batch=self.lr_batch,
            schedule={"kind": schedule.kind, "peak_lr": schedule.peak_lr,
                      "warmup_steps": schedule.warmup_steps, "milestones": list(schedule.milestones),
                      "total_steps": schedule.total_steps, "counts": "batches per rank"},
            sync=self.strategy.name, strategy={k: v for k, v in figures.items() if k != "learners_per_rank"},
            epochs=self.state.history, evaluations=self.state.evaluations, resumed_from=self.resumed_from,
            stopped_by=self.stopped_by, checkpoint=self.last_checkpoint, threads=self.threads,
            decode_workers=self.decode_workers, run_id=self.state.run_id, memory=self.memory)
        result.replicas_identical = replicas_identical
        result.seconds = time.perf_counter() - self.started
        return result


def train(config: TrainConfig, comm, **options: Any) -> TrainResult:
    """Run ``config`` on every rank of ``comm``; see :class:`Trainer`."""
    return Trainer(config, comm, **options).run()
