"""Synchronous data-parallel SGD (S-SGD): forward, backward, one allreduce, update.

Every rank computes the mean loss over its own ``b`` images; the gradients are
summed across the ``P`` ranks and divided by ``P``, which is the gradient of
the mean loss over the global batch of ``P * b`` images. So one step on P
ranks equals one step on one rank with the whole global batch (for models
without batch norm; batch-norm statistics stay local, as in the DIMD paper).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Hashable

import torch
from torch import nn

from dimd.shuffle.normalize import Normalize
from dimd.train.buckets import DeviceReduce, GradientBuckets
from dimd.train.ema import WeightAverage
from dimd.train.flatgrad import Reduce
from dimd.train.noise import NoiseScale
from dimd.train.precision import Precision
from dimd.train.steps import (Batch, Batches, EagerParts, PhaseClock, ScalarWrites, StepParts, StepPlace, StepResult,
                              StepTimes, forward_backward)

#: The tail of the flat buffer: summed across ranks with the gradients, in the same message.
#: EXTRA_SQNORM: this rank's |g|^2 before the allreduce, for the gradient noise scale (0 when off).
#: EXTRA_OVERFLOW: 16-mixed: 1 if this rank's gradients are not finite; summed, every rank skips alike.
EXTRA_LOSS, EXTRA_CORRECT, EXTRA_SAMPLES, EXTRA_STOP, EXTRA_SQNORM, EXTRA_OVERFLOW = range(6)
EXTRAS = 6

#: The figures a step leaves for the host, read in one go after it: the summed extras, then these.
GRAD_SUM, AVERAGED_SQNORM = EXTRAS, EXTRAS + 1
READOUT = EXTRAS + 2


def decays(p: torch.Tensor, decay_bn_and_bias: bool = False) -> bool:
    """Whether ``p`` gets weight decay: weights do; batch-norm scales/shifts and biases (1-d) are exempt."""
    return decay_bn_and_bias or p.ndim > 1


def parameter_groups(model: nn.Module, weight_decay: float, *,
                     decay_bn_and_bias: bool = False) -> list[dict]:
    """Weight decay on weights only: batch-norm scales/shifts and biases (1-d tensors) are exempt."""
    decay: list[nn.Parameter] = []
    exempt: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if decays(p, decay_bn_and_bias) else exempt).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups


def make_optimizer(model: nn.Module, *, lr: float, momentum: float, weight_decay: float,
                   nesterov: bool = False, decay_bn_and_bias: bool = False) -> torch.optim.SGD:
    # SGD reads .grad and never replaces it, so the flat buffer's views survive every step.
    return torch.optim.SGD(parameter_groups(model, weight_decay, decay_bn_and_bias=decay_bn_and_bias),
                           lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


def rate_from_tensor(optimizer: torch.optim.Optimizer, lr: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """Make ``optimizer`` (``torch.optim.SGD`` or :class:`~dimd.train.lars.LARS`) read its rate from ``lr``, a
    0-d tensor on the parameters' device, so a step replayed as a CUDA graph reads each new rate: SGD fused
    (the fused kernel reads the tensor; the foreach and per-tensor paths turn it into a host number first,
    which a capture cannot; LARS's multi-tensor step reads it as it is), the momentum buffers made (zeros:
    the first step's ``buf = grad`` is ``0 * mu + grad``), and ``found_inf`` SGD's skip flag (16-mixed: 1
    when some rank overflowed, and the kernel leaves weights and momentum alone; LARS has none, and the
    config refuses it with 16-mixed). Checkpoints hold the rate as a number (:meth:`SSGD.global_state`)."""
    sgd = type(optimizer) is torch.optim.SGD
    if not (sgd or getattr(optimizer, "reads_tensor_rate", False)):
        raise ValueError(f"an S-SGD step needs torch.optim.SGD (fused, its rate read from a tensor) or dimd's "
                         f"LARS; got {type(optimizer).__name__}")
    if found_inf is not None and not sgd:
        raise ValueError(f"{type(optimizer).__name__} cannot skip an overflowed 16-mixed step on the device")
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise ValueError("an S-SGD step cannot use a differentiable optimizer")
        group.update(lr=lr, **({"fused": True, "foreach": False} if sgd else {}))
        if group["momentum"] != 0:
            for p in group["params"]:
                state = optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if found_inf is not None:
        optimizer.found_inf = found_inf   # type: ignore[attr-defined]  # read by SGD.step, passed to the fused kernel


class SSGD:
    """Synchronous data-parallel SGD as a :class:`~dimd.train.steps.Strategy`: one learner per rank,
    its gradients in :class:`GradientBuckets` averaged over the ranks every step.

    The step is two bodies with the reduction between them (on one rank, nothing to reduce: one
    body), run through ``parts`` (:mod:`dimd.train.steps`: as called, or as CUDA graphs by
    :class:`~dimd.train.graphed_sgd.GraphedSSGD`):

    * ``forward``: zero the flat gradient buffer, forward, loss, backward, the extras (loss, hits,
      samples, the stop flag), 16-mixed's unscale and overflow flag, the local |g|^2 for the noise scale;
    * ``update``: the skip flag from the summed overflow flags, the optimizer (``torch.optim.SGD``,
      fused, its rate a 0-d tensor: :func:`rate_from_tensor`), and the figures the host reads back
      in one read (the extras, the gradients' sum for the divergence check, the averaged |g|^2).

    ``overlap``: reduce each bucket on the communication thread while backward
    goes on (off with ``noise``, whose local |g|^2 needs every gradient before
    any is reduced); the weights are the same either way (docs/library.md).

    ``device_reduce``: reduce the buckets in place on their device (NCCL, gloo;
    :class:`~dimd.train.buckets.DeviceReduce`) instead of with ``reduce``.

    ``noise``: estimate McCandlish et al.'s gradient noise scale as a side
    effect of every step (needs ``world_size`` >= 2): each rank puts its own
    |g|^2 into the extras tail, so the allreduce that sums the gradients also
    sums the squared norms; after it every rank holds the same mean of the
    local norms and the same averaged gradient, and so the same estimate.
    """

    name = "ssgd"
    learners = 1

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, reduce: Reduce,
                 world_size: int, *, bucket_bytes: int = 0, normalize: Normalize | None = None,
                 noise: NoiseScale | None = None, overlap: bool = False, precision: Precision | None = None,
                 device_reduce: DeviceReduce | None = None, parts: StepParts | None = None,
                 label_smoothing: float = 0.0, average: WeightAverage | None = None) -> None:
        if noise is not None and world_size < 2:
            raise ValueError("the gradient noise scale needs at least 2 ranks")
        self.noise = noise
        self.model = model
        self.optimizer = optimizer
        self.reduce = reduce
        self.world_size = world_size
        self.precision = precision or Precision("32-true", next(model.parameters()).device)
        # 16-mixed unscales every gradient and notes an overflow before any bucket is reduced: no overlap.
        overlap = overlap and noise is None and self.precision.loss_scale is None
        self.buckets = GradientBuckets(model.parameters(), reduce, world_size, extras=EXTRAS, bucket_bytes=bucket_bytes,
                                       overlap=overlap, device_reduce=device_reduce)
        self.flat = self.buckets.flat
        self.normalize = normalize
        self.label_smoothing = label_smoothing
        self.average = average            # the weights' moving average (--ema), updated after the step
        self.parts: StepParts = parts or EagerParts()
        device = self.flat.buffer.device
        self.whole = world_size == 1 and not overlap   # nothing to reduce (or wait for): the step is one body
        # What the host writes before a step, and what it reads after.
        self.lr = torch.zeros((), device=device)
        self.stop_flag = torch.zeros((), device=device)
        self.found_inf = torch.zeros((), device=device)
        self.readout = torch.zeros(READOUT, device=device)
        self._writes = ScalarWrites()
        self.clock = PhaseClock(device)
        self._rate_from_tensor()

    def _rate_from_tensor(self) -> None:
        rate_from_tensor(self.optimizer, self.lr, self.found_inf if self.precision.loss_scale is not None else None)

    def _inputs(self, batches: Batches) -> tuple[Hashable, Batch]:
        """The step's batch, and the key of its shapes (the graphed step copies it into static inputs)."""
        (batch,) = batches
        return None, batch

    def step(self, batches: Batches, place: StepPlace, *, stop: bool = False,
             times: StepTimes | None = None) -> StepResult:
        """One step on this rank's batch at ``place.lr``; collective: every step synchronises."""
        parts = self.parts
        parts.begin_step()
        key, batch = self._inputs(batches)
        self._writes.set(self.lr, place.lr)
        self._writes.set(self.stop_flag, 1.0 if stop else 0.0)
        self.clock.start()
        if self.whole:
            parts.run("step", key, partial(self._whole_step, batch))
            self.clock.mark("compute")
        else:
            parts.run("forward", key, partial(self._forward, batch))
            self.clock.mark("compute")
            self.buckets.synchronize()   # MPI: the gradients (and extras) summed over ranks, on the device or the host
            self.clock.mark("allreduce")
            parts.run("update", key, self._update)
            self.clock.mark("optimizer")
        # The one host wait of a step: on a GPU the figures wait for the step's kernels.
        figures = self.readout.tolist()
        spent = self.clock.collect(StepTimes(data=times.data if times is not None else 0.0))
        skipped = self.precision.skip(figures[EXTRA_OVERFLOW])   # the same on every rank, as the update decided
        if self.average is not None and not skipped:
            self.average.after_step(place.step + 1)   # every N steps, one multi-tensor pass on the device
        result = self._result(figures, skipped, spent)
        result.events.extend(parts.events())
        return result

    # -- the step's bodies (run as called, or captured and replayed) ---------------------------

    @torch.no_grad()
    def _forward(self, batch: Batch) -> None:
        images, labels = batch
        flat, extras = self.flat, self.flat.extras
        self.buckets.zero()
        with torch.enable_grad():
            stats = forward_backward(self.model, images, labels, self.normalize, self.precision,
                                     self.label_smoothing)
        extras[EXTRA_LOSS: EXTRA_CORRECT + 1].copy_(stats)
        extras[EXTRA_SAMPLES].fill_(labels.numel())   # a graph is made for one batch shape
        extras[EXTRA_STOP].copy_(self.stop_flag)
        self.precision.unscale(flat.grads, extras[EXTRA_OVERFLOW])   # 16-mixed: this rank's flag
        if self.noise is not None:   # a full pass over the gradients, on the device
            extras[EXTRA_SQNORM].copy_(squared_norm(flat.grads))   # before the allreduce: this rank's

    @torch.no_grad()
    def _update(self) -> None:
        extras, grads, readout = self.flat.extras, self.flat.grads, self.readout
        if self.precision.loss_scale is not None:
            self.found_inf.copy_(extras[EXTRA_OVERFLOW] > 0)   # 1: some rank overflowed, the fused step skips
        if self.noise is not None:   # before the optimizer, which may change .grad in place (Nesterov)
            readout[AVERAGED_SQNORM].copy_(squared_norm(grads))   # the mean of the ranks' gradients
        self.optimizer.step()
        readout[:EXTRAS].copy_(extras)
        # The divergence check: a full pass over the averaged gradients every step (4 bytes per parameter).
        readout[GRAD_SUM].copy_(grads.sum())

    def _whole_step(self, batch: Batch) -> None:
        self._forward(batch)            # one rank: nothing to reduce
        self._update()

    def _result(self, figures: list[float], skipped: bool, spent: StepTimes) -> StepResult:
        """A step's read-back figures (indexed by the ``EXTRA_*`` numbers and :data:`GRAD_SUM`) as its result:
        the noise scale fed, a divergence found at the step it happens (the same step on every rank: the
        summed gradients are alike), a skipped step said."""
        loss_sum, correct, samples, stops = (figures[EXTRA_LOSS], figures[EXTRA_CORRECT], figures[EXTRA_SAMPLES],
                                             figures[EXTRA_STOP])
        if self.noise is not None and not skipped:
            self.noise.update(figures[EXTRA_SQNORM] / self.world_size, figures[AVERAGED_SQNORM],
                              local_batch=round(samples / self.world_size), ranks=self.world_size)
        finite = ((skipped or math.isfinite(loss_sum) and math.isfinite(figures[GRAD_SUM]))
                  and not self.precision.diverged)
        result = StepResult(loss_sum, correct, samples, stops > 0, spent, finite=finite)
        if skipped:
            result.events.append(f"16-mixed: the gradients overflowed on some rank, the step is skipped on every "
                                 f"rank; {self.precision.figures()}")
        return result

    def eval_model(self) -> nn.Module:
        return self.model

    def global_state(self) -> dict[str, Any]:
        """The optimizer with its rate as a number (a run resumes with or without graphs), the loss scale,
        the noise scale's averages."""
        optimizer = self.optimizer.state_dict()
        for group in optimizer["param_groups"]:
            group["lr"] = float(group["lr"])
        state: dict[str, Any] = {"optimizer": optimizer, "precision": self.precision.state_dict()}
        if self.noise is not None:
            state["noise_scale"] = self.noise.state_dict()   # the same on every rank
        if self.average is not None:
            state["ema"] = self.average.state_dict()
        return state

    def local_state(self) -> dict[str, Any]:
        # Batch-norm statistics are per rank (each sees its own batches).
        return {"buffers": {k: v.detach().cpu().clone() for k, v in self.model.named_buffers()}}

    def load_state(self, shared: dict[str, Any], local: dict[str, Any] | None) -> list[str]:
        self.optimizer.load_state_dict(shared["optimizer"])
        self._rate_from_tensor()           # the loaded groups hold a number for the rate
        self._writes.forget()
        self.flat.attach()
        notes = self.precision.load_state_dict(shared["precision"])
        if self.noise is not None:
            if "noise_scale" in shared:
                self.noise.load_state_dict(shared["noise_scale"])
            else:
                notes.append("the checkpoint has no gradient noise scale: its averages start afresh")
        if self.average is not None:
            if "ema" in shared:
                self.average.load_state_dict(shared["ema"])
            else:
                self.average.restart()
                notes.append("the checkpoint has no weight average (--ema): it starts afresh from the weights")
        if local is not None:
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(local["buffers"][name])
        self.parts.reset("a checkpoint was loaded")   # the momentum buffers are new tensors
        return notes

    def figures(self) -> dict[str, Any]:
        noise = self.noise.figures() if self.noise is not None else {}
        return {**noise, **self.precision.figures()}

    def identical(self, comm) -> bool:
        return replicas_identical(self.model, comm)

    def close(self) -> None:
        self.buckets.close()
        self.parts.reset("closed")


def squared_norm(vector: torch.Tensor) -> torch.Tensor:
    """|v|^2 of a flat float32 vector, one pass (a 0-d tensor on the vector's device)."""
    return torch.dot(vector, vector)


def broadcast_state(module: nn.Module, comm, root: int = 0) -> None:
    """Give every rank ``root``'s parameters and buffers (identical initial weights).

    Collective. First every rank checks that it built the same model as
    ``root`` (names, shapes, dtypes): a different one would make the
    broadcasts' sizes disagree, which MPI reports as a truncated message on
    one rank, or as a hang when one rank has more tensors than the others.
    """
    from dimd.mpi import agree_or_raise

    layout = model_layout(module)
    agree_or_raise(comm, layout_difference(layout, comm.bcast(layout, root=root), comm.Get_rank(), root))
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            on_cpu = tensor.device.type == "cpu" and tensor.is_contiguous()
            host = tensor.detach() if on_cpu else tensor.detach().cpu().contiguous()
            comm.Bcast(host.numpy(), root=root)   # MPI: every replica starts from root's weights
            if not on_cpu:
                tensor.copy_(host)


def model_layout(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each parameter and buffer, in the order :func:`broadcast_state` sends them."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named]


def layout_difference(mine: list, roots: list, rank: int, root: int) -> str | None:
    """Where this rank's model differs from ``root``'s, in one line, or None."""
    def show(entry: tuple[str, tuple[int, ...], str]) -> str:
        return f"{entry[0]} {list(entry[1])} {entry[2]}"

    differs = f"rank {rank}'s model differs from rank {root}'s"
    for here, there in zip(mine, roots):
        if here != there:
            return f"{differs}: {show(here)} on rank {rank}, {show(there)} on rank {root}; build the same model"
    if len(mine) != len(roots):
        longer, first = (rank, mine[len(roots)]) if len(mine) > len(roots) else (root, roots[len(mine)])
        return (f"{differs}: {len(mine)} parameters and buffers against {len(roots)} (the first one only on rank "
                f"{longer}: {show(first)}); build the same model")
    return None


def replicas_identical(module: nn.Module, comm) -> bool:
    """Whether every rank holds bit-identical parameters (a crc32 of their bytes, compared)."""
    return identical_across_ranks([p.detach() for p in module.parameters()], comm)


def identical_across_ranks(tensors: list[torch.Tensor], comm) -> bool:
    """Collective: whether every rank holds exactly the same bytes in ``tensors``."""
    import zlib

    digest = 0
    for t in tensors:
        digest = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), digest)
    everyone = comm.allgather(digest)   # MPI: compare the ranks' checksums
    return all(d == everyone[0] for d in everyone)
