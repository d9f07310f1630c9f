"""A run's set-up: a :class:`TrainConfig` and a communicator made into a frozen :class:`RunPlan`.

The plan is everything the loop (:mod:`dimd.train.engine`) runs with, chosen
once, collectively, before the first step, from top to bottom:

1. the checks that need the job but not the data, each one line before minutes of loading;
2. the hardware: torch threads and the device (one GPU per rank);
3. the data: each rank's share in memory (:class:`dimd.shuffle.DistributedStore`) and the loaders over it;
4. the model, built alike on every rank and started from rank 0's weights, its precision;
5. the synchronisation: the allreduce algorithm, CUDA graphs, overlap, the device group and the strategy;
6. the learning-rate schedule.

Every choice the config leaves open is made here, with its reason: the
allreduce (``algorithm_choice``: how, and why not nccl), CUDA graphs
(``graphs.rule``), overlap (``overlap_why``); the JSON reports them. The
rules between settings are :mod:`dimd.train.rules`'s: the config refused
what was asked for and breaks one; here they apply to the defaults, and
refuse what only a run can tell (the device ``auto`` found). Not the batch
planner (:mod:`dimd.train.plan`, ``dimd plan-batch``), which builds on this.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from dimd.allreduce import device_group
from dimd.errors import DimdError
from dimd.mpi import agree_or_raise, agreed
from dimd.train.checkpoint import resume_point
from dimd.train.config import TrainConfig
from dimd.train.flatgrad import Reduce
from dimd.train.hardware import default_decode_workers, pick_device, set_threads
from dimd.train.model_source import recorded_source
from dimd.train.models import build_model, gradient_bytes, model_problem, parameter_count
from dimd.train.precision import Precision, memory_format
from dimd.train.rules import branches_need_graphs, graphs_need_a_gpu, graphs_rule, overlap_cannot_be_captured
from dimd.train.schedule import Schedule, make_schedule
from dimd.train.steps import Strategy


@dataclass(frozen=True)
class GraphChoice:
    """Whether the step replays as CUDA graphs, why (for the JSON), whether ``cuda_graphs`` decided it rather
    than its default (``explicit``: a capture that fails then stops the run, where on by default the run falls
    back to eager steps), and where (None: the device's own)."""

    on: bool
    rule: str
    explicit: bool = False
    backend: Any = None


@dataclass(frozen=True)
class RunPlan:
    """What a run is made of, chosen before its first step (collective), with each choice's reason.

    :meth:`close` ends what it started.
    """

    config: TrainConfig
    comm: Any
    # -- hardware
    device: torch.device
    threads: int                       # torch threads per rank
    decode_workers: int                # the loader's decoding processes per rank
    # -- data
    resume_path: str | None            # the checkpoint to continue from
    store: Any                         # dimd.shuffle.DistributedStore: this rank's share of the training set
    val_store: Any
    val_label_map: torch.Tensor | None  # validation label -> training label, where the classes are ordered apart
    loader: Any                        # the training batches on the device (dimd.shuffle.device_feed)
    val_loader: Any
    #: Batches of ``batch_size`` per rank per epoch; the schedule counts these, so its
    #: position is the same whatever the learners per rank.
    batches_per_epoch: int
    # -- model
    model: torch.nn.Module
    model_info: dict[str, Any]         # name, parameters, gradient bytes, classes (and a user's source)
    normalize: Any                     # dimd.shuffle.normalize.Normalize: uint8 batches to the model's input
    precision: Precision
    # -- synchronisation, each choice with its reason
    algorithm: str
    algorithm_choice: dict[str, Any]   # the JSON's allreduce_choice: how, why not nccl, overlap and why
    graphs: GraphChoice
    overlap: bool
    group: Any                         # nccl, gloo, torch: the torch.distributed group; None for host algorithms
    calibration: Any                   # SMA: the batches its batch-norm recompute reads; None for S-SGD
    strategy: Strategy
    # -- schedule
    schedule: Schedule
    #: The batch ``lr`` is scaled by (linear scaling, lr x batch / 256): S-SGD's global batch
    #: per step; under SMA a learner's own batch, since every learner steps on its own.
    lr_batch: int

    @property
    def world(self) -> int:
        return int(self.comm.Get_size())

    def close(self) -> None:
        """End what the plan started: the loaders' workers, the strategy's threads, the device group."""
        self.loader.close()
        self.val_loader.close()
        if self.calibration is not None:
            self.calibration.close()
        self.strategy.close()
        if self.group is not None:
            self.group.close()


def plan_run(config: TrainConfig, comm: Any, *, on_event: Callable[[str], None] = lambda line: None,
             device: torch.device | None = None, graph_backend: Any = None) -> RunPlan:
    """Collective: the run ``config`` describes on every rank of ``comm``, set up and ready for its first step.

    ``on_event`` hears the lines worth logging (a thread note, the load). ``device`` overrides
    ``config.device`` (``plan-batch convergence`` picks each rank's GPU on the whole job, then trains on a
    sub-communicator). ``graph_backend``: replay the steps as graphs there (tests: the CPU's
    :class:`~dimd.train.graphs.StandIn`).
    """
    from dimd.shuffle.normalize import Normalize
    from dimd.train.sgd import broadcast_state

    # -- 1, 2: the checks before loading, the hardware
    check_before_loading(config, comm)
    threads, warning = set_threads(config.threads, comm)   # MPI: the node's cores are shared by its ranks
    if warning:
        on_event(f"note: {warning}")
    device = device if device is not None else pick_device(config.device, comm)
    check_device(config, device, comm, graphs_given=graph_backend is not None)
    resume_path = check_inputs_before_loading(config, comm)

    # -- 3: data
    workers = config.decode_workers or default_decode_workers(comm)   # MPI: the node's cores
    store, val_store, label_map = load_data(config, comm, workers, on_event)
    loader, val_loader = make_loaders(config, store, val_store, device, workers)
    batches_per_epoch = loader.steps_per_epoch
    learners = config.sma.fixed_learners
    if learners > batches_per_epoch:   # not one step per epoch: nothing would train
        raise DimdError(f"`learners` {learners} per rank take {learners} batches per step, but a rank has "
                        f"{batches_per_epoch} batches of {config.batch_size} per epoch: lower `learners` "
                        f"to at most {batches_per_epoch}, or `batch_size`")

    # -- 4: the model
    torch.manual_seed(config.seed)
    model = build_agreed(config, len(store.classes), comm)
    tensor_format = memory_format(config.channels_last if config.sync == "ssgd" else False, device, model)
    model.to(device, memory_format=tensor_format)  # type: ignore[call-overload]  # torch's stub lacks it
    broadcast_state(model, comm)   # MPI: every rank starts from rank 0's weights
    if config.ssgd.compile:
        # In place: the state dict's names stay (checkpoints, export); the parameters and their gradient hooks
        # are the module's own, so the buckets, overlap and the flat buffer see the same gradients.
        model.compile()
    nbytes = gradient_bytes(model)
    model_info = {"name": config.model, "parameters": parameter_count(model), "gradient_bytes": nbytes,
                  "classes": len(store.classes), **recorded_source(config.model)}
    precision, normalize = Precision(config.precision, device), Normalize(device, tensor_format)

    # -- 5: synchronisation
    algorithm, algorithm_choice = choose_allreduce(config, nbytes, comm, device)   # MPI: measured if not given
    graphs = graphs_choice(config, device, model, comm, graph_backend)   # MPI: agreed
    overlap, overlap_why = overlap_choice(config, device, comm, graphs.on)
    algorithm_choice.update(overlap=overlap, overlap_why=overlap_why)
    #: nccl, gloo: torch.distributed's group, started from MPI (the rendezvous within the stall timeout)
    group = device_group(algorithm, comm, device, stall_timeout=config.stall_timeout)
    try:
        calibration = calibration_source(config, store, device, workers) if config.sync == "sma" else None
        strategy = make_strategy(config, model, make_reducer(algorithm, comm), comm.Get_size(), normalize,
                                 batches_per_epoch, overlap, calibration, precision, graphs, group)
    except BaseException:   # the group ends with the run; a set-up that fails ends it now
        if group is not None:
            group.close()
        raise

    # -- 6: schedule
    lr_batch = config.batch_size * comm.Get_size() if config.sync == "ssgd" else config.batch_size
    schedule = make_schedule(
        config.schedule, config.lr, global_batch=lr_batch,  # type: ignore[arg-type]  # TrainConfig checked it
        steps_per_epoch=batches_per_epoch, epochs=config.epochs, scaling=config.lr_scaling,
        warmup_epochs=config.warmup_epochs, milestones=config.milestones, power=config.power)
    return RunPlan(config=config, comm=comm, device=device, threads=threads, decode_workers=workers,
                   resume_path=resume_path, store=store, val_store=val_store, val_label_map=label_map,
                   loader=loader, val_loader=val_loader, batches_per_epoch=batches_per_epoch, model=model,
                   model_info=model_info, normalize=normalize, precision=precision, algorithm=algorithm,
                   algorithm_choice=algorithm_choice, graphs=graphs, overlap=overlap, group=group,
                   calibration=calibration, strategy=strategy, schedule=schedule, lr_batch=lr_batch)


# -- 1: before loading ------------------------------------------------------------------------


def check_before_loading(config: TrainConfig, comm: Any) -> None:
    """Collective: the checks that need the job but not the data, one clear line before minutes of loading.

    The model is named and, for a user's, its file or module imported, but not built: a builder may
    refuse any class count but the data's, which the load learns. Agreed, so a file some nodes lack
    stops every rank in order.
    """
    if config.ssgd.noise_scale and comm.Get_size() < 2:
        raise DimdError("`noise_scale` needs at least 2 ranks: it compares each rank's gradient with their "
                        "average (run under mpirun -n 2 or more)")
    agree_or_raise(comm, model_problem(config.model))   # MPI: one rank's import error stops every rank


def check_device(config: TrainConfig, device: torch.device, comm: Any, *, graphs_given: bool = False) -> None:
    """Collective: what the config asked of the device and this job cannot do (``decode`` gpu without CUDA or
    torchvision, ``cuda_graphs`` where ``device`` auto found no GPU, an ``allreduce`` group some rank cannot
    start), each one line before the data loads; agreed, since each rank sees only its own device and
    libraries. ``graphs_given``: a graph backend was given (tests: the stand-in replays on the CPU)."""
    if config.decode == "gpu":
        from dimd.shuffle.gpu_decode import gpu_decode_problem

        problem = gpu_decode_problem() if device.type == "cuda" else "decode gpu needs `device` cuda"
        agree_or_raise(comm, problem)   # MPI: every rank asks, as every rank has the same config
    gpu = graphs_need_a_gpu(device.type)
    if config.cuda_graphs and not graphs_given:
        agree_or_raise(comm, None if gpu.on else gpu.refusal)   # MPI: the device kind is agreed
    check_device_allreduce(config, device, comm)


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
    schedule = config.size_schedule
    if schedule is not None:   # crops larger than the packed images: refused before the load, by every rank
        from dimd.format import PackedDataset

        short_side = comm.bcast(int(PackedDataset(config.train).attrs["short_side"]) if comm.Get_rank() == 0
                                else None)   # MPI: rank 0 read the index (packed_record_count opened it)
        try:
            if short_side > 0:   # 0: packed as the images were, no short side to check against
                schedule.check_short_side(short_side, config.train)
        except DimdError as exc:
            raise agreed(comm, str(exc)) from None
    return resume_point(config, comm)   # MPI: a checkpoint that is named but missing stops every rank


# -- 3: data ----------------------------------------------------------------------------------


def load_data(config: TrainConfig, comm: Any, workers: int, on_event: Callable[[str], None]) -> tuple[Any, Any, Any]:
    """Collective: each rank's share of the training and validation sets in memory, and the validation
    labels' map to the training ones (None where the classes are in the same order)."""
    from dimd.shuffle import DistributedStore

    t0 = time.perf_counter()
    store = DistributedStore.load(config.train, comm, groups=config.groups, memory_limit=config.memory_limit,
                                  decode_workers=workers, batch_bytes=loaders_memory(config, workers))
    val_store = DistributedStore.load(config.val, comm, groups=1, memory_limit=config.memory_limit)
    try:
        label_map = val_label_map(store.classes, val_store.classes, config.val, config.train)
    except DimdError as exc:   # every rank read the same two indexes
        raise agreed(comm, str(exc)) from None
    on_event(f"loaded {store.total} training and {val_store.total} validation records into memory in "
             f"{time.perf_counter() - t0:.1f}s")
    return store, val_store, label_map


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
    sizes = config.size_schedule   # progressive resizing: each epoch decoded at its size, the slots at the largest
    loader = BatchLoader(source, config.batch_size, config.largest_image_size, train=True, decode_workers=workers,
                         seed=config.seed, pin_memory=pin, crop_scale=config.crop_scale, sizes=sizes)
    val_loader = BatchLoader(val_store, config.eval_batch_size or config.batch_size,
                             config.val_image_size or config.image_size, train=False, decode_workers=workers,
                             seed=config.seed, pin_memory=pin, crop_ratio=config.val_crop_ratio)
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
    return (batch_memory(config.batch_size, config.largest_image_size, slots, workers)
            + batch_memory(config.eval_batch_size or config.batch_size, config.val_image_size or config.image_size,
                           3, 0))


def calibration_source(config: TrainConfig, store: Any, device: torch.device, workers: int) -> Any:
    """Training batches for SMA's batch-norm recompute, from a loader of their own (seed + 1) that
    shares the training loader's workers, so the training loader's position and batches stay as they are."""
    from dimd.shuffle import BatchLoader
    from dimd.train.batchnorm import CalibrationBatches

    batch = min(config.eval_batch_size or config.batch_size, store.total // store.comm.Get_size())
    return CalibrationBatches(BatchLoader(store, batch, config.image_size,
                                          train=True, decode_workers=workers, seed=config.seed + 1,
                                          pin_memory=device.type == "cuda", crop_scale=config.crop_scale))


# -- 4: the model -----------------------------------------------------------------------------


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


# -- 5: synchronisation -----------------------------------------------------------------------


def choose_allreduce(config: TrainConfig, nbytes: int, comm: Any, device: torch.device) -> tuple[str, dict[str, Any]]:
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


def graphs_choice(config: TrainConfig, device: torch.device, model: torch.nn.Module, comm: Any,
                  backend: Any = None) -> GraphChoice:
    """Collective: ``cuda_graphs``, or where unset the default of :func:`dimd.train.rules.graphs_rule`.

    Every rank has the same config, model and kind of device, so every rank decides alike; an explicit
    ``cuda_graphs`` the run cannot honour stops every rank with one line. ``backend``: a stand-in
    for the GPU (tests run the graphed steps on the CPU with :class:`~dimd.train.graphs.StandIn`). The
    device was checked before the load (:func:`check_device`).
    """
    from dimd.train.graphs import capture_problem

    explicit = config.cuda_graphs is not None
    if backend is not None:
        return GraphChoice(True, f"on: {backend.name} backend given to the trainer", explicit, backend)
    problem = capture_problem(model)
    if config.cuda_graphs:
        agree_or_raise(comm, problem and f"{problem}: give it a momentum, or leave out `cuda_graphs`")  # MPI: one model
    on, rule = graphs_rule(config.cuda_graphs, device.type, config.batch_size, config.largest_image_size,
                           overlap=config.ssgd.overlap, learner_compute=config.sma.learner_compute,
                           compiled=config.ssgd.compile)
    if on and problem:
        on, rule = False, f"off: {problem}"
    if config.sync == "sma":
        branches = branches_need_graphs(config.sma.learner_compute, (on, rule))
        agree_or_raise(comm, None if branches.on else branches.refusal)   # MPI: every rank decides alike
    return GraphChoice(on, rule, explicit)


def overlap_choice(config: TrainConfig, device: torch.device, comm: Any, graphs: bool = False) -> tuple[bool, str]:
    """Collective: ``overlap``, or where unset: S-SGD on several ranks with a core or GPU free for the
    communication, unless the step runs as CUDA graphs (which cannot capture the communication thread).
    Also why, in one line."""
    if config.ssgd.overlap is not None:
        return config.ssgd.overlap, "requested"
    from dimd.train.buckets import core_free_for_communication

    free = core_free_for_communication(device, comm)   # MPI: collective (the node's ranks)
    if config.sync != "ssgd":
        return False, "off: SMA averages models, not gradients"
    if config.ssgd.noise_scale:
        return False, "off: the noise scale needs each rank's whole gradient before any bucket is reduced"
    if comm.Get_size() == 1:
        return False, "off: a single rank reduces nothing"
    if graphs:
        return False, f"off: the step replays as CUDA graphs, and {overlap_cannot_be_captured(True).why}"
    if not free:
        return False, "off: no core or GPU is free for the communication thread"
    return True, "on: a core or GPU is free for the communication thread"


def make_reducer(algorithm: str, comm: Any) -> Reduce:
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
                                            "fallback": not graphs.explicit}
        return sma_class(model, reduce, world_size, learners=None if sma.autotune else sma.fixed_learners,
                         alpha=sma.alpha, momentum=cfg.momentum, central_momentum=sma.sma_momentum,
                         weight_decay=cfg.weight_decay, decay_bn_and_bias=cfg.decay_bn_and_bias,
                         sync_every=sma.sync_every, compute=sma.learner_compute,
                         normalize=normalize, threads=torch.get_num_threads(),
                         autotune_threshold=sma.autotune_threshold,
                         max_learners=batches_per_epoch, synchronize=sync, calibration=calibration,
                         device_reduce=device_reduce, label_smoothing=cfg.label_smoothing,
                         lars_trust=cfg.lars_trust if cfg.optimizer == "lars" else None, **extra)
    from dimd.train.optimizers import build_optimizer
    from dimd.train.sgd import SSGD

    optimizer = build_optimizer(cfg.optimizer, model, lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay, nesterov=cfg.ssgd.nesterov,
                                decay_bn_and_bias=cfg.decay_bn_and_bias, trust=cfg.lars_trust)
    noise = None
    if cfg.ssgd.noise_scale:
        from dimd.train.noise import NoiseScale

        noise = NoiseScale()
    average = None
    if cfg.ssgd.ema is not None:
        from dimd.train.ema import WeightAverage

        average = WeightAverage(model, cfg.ssgd.ema, cfg.ssgd.ema_every)
    common = dict(normalize=normalize, noise=noise, precision=precision, device_reduce=device_reduce,
                  label_smoothing=cfg.label_smoothing, average=average)
    if graphed:
        from dimd.train.graphed_sgd import GraphedSSGD

        assert graphs is not None
        return GraphedSSGD(model, optimizer, reduce, world_size, backend=graphs.backend,
                           bucket_bytes=cfg.bucket_bytes(False), rule=graphs.rule, fallback=not graphs.explicit,
                           **common)
    return SSGD(model, optimizer, reduce, world_size, bucket_bytes=cfg.bucket_bytes(overlap), overlap=overlap,
                **common)
