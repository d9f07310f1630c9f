"""Time Gamma(m): forward, backward and optimizer step of a real model at each per-rank batch.

The step is ``dimd train``'s own S-SGD step (:class:`dimd.train.sgd.SSGD`)
with its allreduce left out of the time (the communication model times that):
the same model zoo, optimizer (:func:`dimd.train.sgd.make_optimizer` with
``dimd train``'s momentum and weight decay), input normalisation, gradients
held in one flat buffer, and the same torch threads per rank (cores / ranks on the node,
unless ``--threads`` or OMP_NUM_THREADS says otherwise). The inputs are
synthetic by default: random uint8 images and labels, made once per batch
size, so the time is compute only. With ``data`` they are real batches from
``dimd train``'s loader and the wait for each counts: the loader's decoding
worker processes compete with the step for the cores
(bench/probes/decode_contention.py measures by how much), which synthetic inputs
do not see.

Under MPI every rank runs the same steps at once, after a barrier each, so
ranks that share a node share its cores and memory bandwidth as they do in
training; a step's time is its slowest rank's (synchronous SGD waits for it).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from dimd.errors import DimdError
from dimd.stall import watch_job
from dimd.train.plan.config import StepTimeConfig, default_classes


#: A small rate: the same synthetic batch is seen again and again, and a
#: diverging model (inf/nan, denormals) would time differently.
LR = 0.01


def model_gradient_bytes(model: str, classes: int | None = None) -> int:
    """Bytes one allreduce of ``model``'s gradients moves (float32), built on torch's meta device."""
    import torch

    from dimd.train.models import MODELS, build_model, gradient_bytes

    if model not in MODELS:
        raise DimdError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    with torch.device("meta"):
        return gradient_bytes(build_model(model, classes if classes is not None else default_classes(model)))


def gradient_size(model: str | None, classes: int | None, nbytes: int | None) -> tuple[int | None, str]:
    """The bytes to predict one allreduce for, and where they come from: a model, a byte count, or (None)
    the size the bench results recorded."""
    if model is not None:
        return model_gradient_bytes(model, classes), f"model {model}, {classes or default_classes(model)} classes"
    if nbytes is not None:
        return nbytes, "--bytes"
    return None, "recorded by bench-allreduce --model"


@dataclass(frozen=True)
class StepTimeSamples:
    """Per batch size: every timed step's seconds (slowest rank) and each rank's median."""

    batches: tuple[int, ...]
    step_seconds: tuple[tuple[float, ...], ...]
    rank_medians: tuple[tuple[float, ...], ...]
    world_size: int
    threads: int
    device: str
    num_classes: int
    parameters: int
    gradient_bytes: int
    inputs: str = "synthetic (random uint8 images and labels)"
    step: str = "dimd train's S-SGD step (forward + backward + optimizer step), less its allreduce"


def measure_step_times(config: StepTimeConfig, comm: Any,
                       on_step: Callable[[int], None] | None = None) -> StepTimeSamples:
    """Collective: time ``config.steps`` steps at every batch size, on every rank at once."""
    import torch
    from mpi4py import MPI

    from dimd.shuffle.normalize import Normalize
    from dimd.train.config import TrainConfig
    from dimd.train.hardware import default_decode_workers, pick_device, set_threads
    from dimd.train.models import build_model, gradient_bytes, parameter_count
    from dimd.train.sgd import SSGD, make_optimizer
    from dimd.train.steps import StepPlace

    advance = on_step or (lambda n: None)
    threads, _ = set_threads(config.threads, comm)
    device = pick_device(config.device, comm)
    torch.manual_seed(config.seed + comm.Get_rank())
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    store = None
    if config.data is not None:
        from dimd.mpi import agree_or_raise
        from dimd.shuffle import DistributedStore
        from dimd.shuffle.loader import too_few_for_a_batch
        from dimd.shuffle.store import packed_record_count

        # MPI: every rank refuses, before any step, a largest batch the set cannot give each rank
        records = packed_record_count(comm, config.data)
        agree_or_raise(comm, too_few_for_a_batch(config.data, records, comm.Get_size(),
                                                 max(config.batch_sizes)))
        store = DistributedStore.load(config.data, comm)   # MPI: collective; each rank holds its share
    classes = len(store.classes) if store is not None else config.num_classes
    model = build_model(config.model, classes).to(device)
    momentum, weight_decay = float(defaults["momentum"]), float(defaults["weight_decay"])  # type: ignore[arg-type]
    optimizer = make_optimizer(model, lr=LR, momentum=momentum, weight_decay=weight_decay)
    # One rank's step, its allreduce a no-op: the ranks run at once but each times its own step (which ends
    # with a read of its figures, so on a GPU its time is the device's).
    sgd = SSGD(model, optimizer, lambda array: None, 1, normalize=Normalize(device))

    from dimd.host import available_memory
    from dimd.mpi import agree_or_raise, node_local_ranks

    # MPI: the largest batch's input must fit every rank's share of its node's memory
    agree_or_raise(comm, input_memory_problem(config, available_memory() // node_local_ranks(comm)))
    workers = config.decode_workers or default_decode_workers(comm)   # MPI: the node's cores, shared by its ranks
    per_step, medians = [], []
    with watch_job(comm, config.stall_timeout) as watchdog:   # MPI: a lost peer ends the job, not hangs it
        for batch in config.batch_sizes:
            loader = None
            if store is not None:   # real batches, the loader's decoding workers running beside the step
                from dimd.shuffle import BatchLoader

                loader = BatchLoader(store, batch, config.image_size, train=True, seed=config.seed,
                                     decode_workers=workers,
                                     crop_scale=config.crop_scale or TrainConfig.crop_scale,
                                     pin_memory=device.type == "cuda")
                batches = endless(loader)
            else:
                images = torch.randint(0, 256, (batch, 3, config.image_size, config.image_size), dtype=torch.uint8)
                labels = torch.randint(0, classes, (batch,))
                if device.type == "cuda":
                    images, labels = images.pin_memory(), labels.pin_memory()
            times = np.empty(config.steps)
            try:
                for i in range(config.warmup + config.steps):
                    with watchdog.waiting(f"the barrier before step {i + 1} at {batch} images per rank"):
                        comm.Barrier()
                    start = time.perf_counter()
                    if loader is not None:
                        images, labels = next(batches)   # the wait for a batch counts, as in training
                    result = sgd.step([(images, labels)], StepPlace(lr=LR))
                    if i >= config.warmup:
                        times[i - config.warmup] = time.perf_counter() - start - result.times.allreduce
                    advance(1)
                with watchdog.waiting(f"the figures at {batch} images per rank"):
                    slowest = np.empty_like(times)
                    comm.Allreduce(times, slowest, op=MPI.MAX)
                    rank_medians = comm.allgather(float(np.median(times)))
            except RuntimeError as exc:   # out of memory at a large batch, most often
                raise DimdError(f"step-time: {config.model} at {batch} images per rank failed: "
                                f"{str(exc).splitlines()[0]}") from None
            finally:
                if loader is not None:
                    loader.close()
            per_step.append(tuple(slowest.tolist()))
            medians.append(tuple(float(m) for m in rank_medians))
    return StepTimeSamples(tuple(config.batch_sizes), tuple(per_step), tuple(medians), comm.Get_size(), threads,
                     str(device), classes, parameter_count(model), gradient_bytes(model),
                     **({} if config.data is None else {
                         "inputs": f"{config.data} through dimd train's loader "
                                   f"({workers} decoding worker(s) "
                                   f"per rank running beside the step)",
                         "step": "the wait for the loader's batch + dimd train's S-SGD step (forward + "
                                 "backward + optimizer step), less its allreduce"}))


def input_memory_problem(config: StepTimeConfig, budget: int) -> str | None:
    """Why the largest batch's input alone does not fit ``budget`` bytes per rank, or None.

    A lower bound (the model's activations come on top): enough to refuse an
    image size that could never run before torch tries to allocate it.
    """
    from dimd.shuffle.memory import INPUT_BYTES_PER_VALUE
    from dimd.units import format_bytes

    batch = max(config.batch_sizes)
    need = batch * 3 * config.image_size ** 2 * INPUT_BYTES_PER_VALUE
    if need > budget:
        return (f"`image_size` {config.image_size} at {batch} images per rank needs {format_bytes(need)} for "
                f"the input alone, but a rank has {format_bytes(budget)} of available memory on this node")
    return None


def endless(loader: Any) -> Iterator[tuple[Any, Any]]:
    """The loader's training batches, epoch after epoch (a step-time sweep may outlast an epoch)."""
    epoch = 0
    while True:
        yield from loader.epoch(epoch)
        epoch += 1


def step_time_figures(measured: StepTimeSamples) -> dict[str, Any]:
    """The ``plan-batch step-time`` figures: Gamma fitted to the per-batch medians, then every batch's
    medians, spread and residual."""
    from dimd.report import spread
    from dimd.train.plan.steptime import fit_step_time

    fit = fit_step_time(measured.batches, [float(np.median(s)) for s in measured.step_seconds])
    rows = []
    fitted = dict(zip(fit.batches, zip(fit.fitted, fit.residuals)))
    for batch, steps, ranks in zip(measured.batches, measured.step_seconds, measured.rank_medians):
        model_s, residual = fitted[batch]
        rows.append({"batch": batch, "seconds": spread(steps), "rank_medians": list(ranks),
                     "images_per_s": batch * measured.world_size / float(np.median(steps)),
                     "fit_s": model_s, "residual": residual})
    return {**fit.figures(), "batches": rows, "world_size": measured.world_size, "threads": measured.threads,
            "device": measured.device, "classes": measured.num_classes, "parameters": measured.parameters,
            "gradient_bytes": measured.gradient_bytes, "inputs": measured.inputs,
            "step": f"{measured.step}; the slowest rank's time per step"}
