"""S-SGD's step replayed as CUDA graphs: :class:`~dimd.train.sgd.SSGD`'s step, captured (:mod:`dimd.train.graphs`).

On one rank (nothing to reduce) the step is one graph. On several it is two graphs with the
gradients' reduction between them, as in the eager step: on the device where the strategy has a
``device_reduce`` (NCCL's group, :mod:`dimd.allreduce.group`: the buckets' collectives are queued on
NCCL's stream after the first graph's work and the second graph's replay waits for them, with
no copy to the host and no wait on the host), else on the host (dimd's allreduce sums host buffers):

* ``forward``: zero the flat gradient buffer, forward, loss, backward, the extras (loss, hits,
  samples, the stop flag), 16-mixed's unscale and overflow flag, the local |g|^2 for the noise scale;
* ``update``: the skip decision from the summed overflow flags, the optimizer, and the figures
  the host reads back (the extras, the gradients' sum for the divergence check, the averaged |g|^2).

The optimizer is ``torch.optim.SGD`` made replayable (:func:`capturable_sgd`): fused (one kernel
over every parameter), reading its rate from a 0-d device tensor (the fused kernel reads the
tensor; the foreach and per-tensor paths turn it into a host number first), its momentum buffers
made before the first capture (zeros: the first step's ``buf = grad`` is ``0 * mu + grad``), and
under 16-mixed given a ``found_inf`` flag, 1 when some rank overflowed, with which the fused kernel
leaves weights and momentum alone, as the eager step skips ``optimizer.step()``. Checkpoints hold
the optimizer as the eager step saves it (the rate a number), so a run resumes with or without graphs.
"""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial
from typing import Any, ContextManager

import torch
from torch import nn

from dimd.private_apis import unscale_and_find_non_finite_
from dimd.shuffle.normalize import Normalize
from dimd.train.buckets import DeviceReduce
from dimd.train.flatgrad import Reduce
from dimd.train.graphs import (WARMUP_STEPS, Backend, ScalarWrites, StaticBatch, StaticInputs, StepGraphs, backend_for,
                               capture_problem)
from dimd.train.noise import NoiseScale
from dimd.train.precision import Precision
from dimd.train.sgd import (EXTRA_CORRECT, EXTRA_LOSS, EXTRA_OVERFLOW, EXTRA_SAMPLES, EXTRA_SQNORM, EXTRA_STOP,
                            EXTRAS, SSGD, squared_norm)
from dimd.train.steps import Batches, StepPlace, StepResult, StepTimes, forward_backward

#: The figures read back after a step: the extras, then these.
GRAD_SUM, AVERAGED_SQNORM = EXTRAS, EXTRAS + 1
READOUT = EXTRAS + 2


class DeviceLossScale:
    """The precision a captured step computes in: 16-mixed's loss scale as a 0-d device tensor.

    The graph multiplies the loss by the tensor and divides the gradients by it, so the scale can
    change without a new capture; the host keeps the rule (:class:`~dimd.train.precision.LossScale`,
    fed the summed overflow flags after each step) and writes a new scale with :meth:`refresh`.
    Autocast runs without its cast cache, as PyTorch asks of captured autocast regions.
    """

    def __init__(self, precision: Precision, device: torch.device) -> None:
        self.precision = precision
        self.scale = torch.ones((), device=device)
        self._writes = ScalarWrites()
        self.refresh()

    def autocast(self) -> ContextManager[Any]:
        if self.precision.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.precision.device_type, dtype=self.precision.dtype, cache_enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        if self.precision.loss_scale is None:
            loss.backward()
        else:
            (loss * self.scale).backward()

    def unscale(self, grads: torch.Tensor, flag: torch.Tensor) -> None:
        """``grads`` divided by the scale in place; ``flag`` set to 1 if any is not finite, else 0."""
        found = torch.zeros((), dtype=torch.float32, device=grads.device)
        unscale_and_find_non_finite_(grads, found, self.scale.reciprocal())
        flag.copy_(found)

    def refresh(self) -> None:
        """Write the host's current scale into the tensor, if it changed."""
        loss_scale = self.precision.loss_scale
        if loss_scale is not None:
            self._writes.set(self.scale, loss_scale.scale)


def capturable_sgd(optimizer: torch.optim.Optimizer, lr: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """Make ``optimizer`` (``torch.optim.SGD``) replayable: fused, reading ``lr`` (a 0-d tensor on the
    parameters' device), its momentum buffers made (zeros), ``found_inf`` its skip flag (16-mixed)."""
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(f"a graphed S-SGD step needs torch.optim.SGD (fused, its rate read from a tensor); "
                         f"got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise ValueError("a graphed S-SGD step cannot use a differentiable optimizer")
        group.update(lr=lr, fused=True, foreach=False)
        if group["momentum"] != 0:
            for p in group["params"]:
                state = optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if found_inf is not None:
        optimizer.found_inf = found_inf   # type: ignore[attr-defined]  # read by SGD.step, passed to the fused kernel


class GraphedSSGD(SSGD):
    """:class:`~dimd.train.sgd.SSGD` whose step replays as CUDA graphs; the same weights as the eager step.

    ``backend``: where graphs are captured (default: CUDA on a GPU, :class:`~dimd.train.graphs.StandIn`
    elsewhere); ``device_reduce``: reduce the buckets in place on the device between the two graphs
    (:class:`~dimd.train.buckets.DeviceReduce`); ``rule``: why graphs are on, for the JSON. No overlap:
    a graph cannot capture the communication thread, nor a bucket's collective started from a hook.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, reduce: Reduce, world_size: int, *,
                 backend: Backend | None = None, device_reduce: DeviceReduce | None = None, bucket_bytes: int = 0,
                 normalize: Normalize | None = None, synchronize: Any = None, noise: NoiseScale | None = None,
                 precision: Precision | None = None, warmup: int = WARMUP_STEPS, rule: str = "on") -> None:
        problem = capture_problem(model)
        if problem:
            raise ValueError(problem)
        super().__init__(model, optimizer, reduce, world_size, bucket_bytes=bucket_bytes, normalize=normalize,
                         synchronize=synchronize, noise=noise, overlap=False, precision=precision,
                         device_reduce=device_reduce)
        device = self.flat.buffer.device
        self.rule = rule
        self.graphs = StepGraphs(backend or backend_for(device), warmup=warmup)
        self.inputs = StaticInputs(device)
        self.whole = world_size == 1
        # What the host writes before a replay, and what it reads after.
        self.lr = torch.zeros((), device=device)
        self.stop_flag = torch.zeros((), device=device)
        self.found_inf = torch.zeros((), device=device)
        self.readout = torch.zeros(READOUT, device=device)
        self.device_precision = DeviceLossScale(self.precision, device)
        self._writes = ScalarWrites()
        self._eager_flags = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]
        self._make_capturable()

    def _make_capturable(self) -> None:
        capturable_sgd(self.optimizer, self.lr, self.found_inf if self.precision.loss_scale is not None else None)

    def step(self, batches: Batches, place: StepPlace, *, stop: bool = False,
             times: StepTimes | None = None) -> StepResult:
        """One step on this rank's batch at ``place.lr`` (collective, as the eager step), copied into the
        graph's inputs first."""
        spent = StepTimes(data=times.data if times is not None else 0.0)
        t0 = time.perf_counter()
        graphs = self.graphs
        graphs.begin_step()
        key, (static,) = self.inputs.load(batches)
        self._writes.set(self.lr, place.lr)
        self._writes.set(self.stop_flag, 1.0 if stop else 0.0)
        if self.whole:
            graphs.run("step", key, partial(self._whole_step, static))
            t1 = t2 = None
        else:
            graphs.run("forward", key, partial(self._forward, static))
            self._sync()
            t1 = time.perf_counter()
            self.buckets.synchronize()   # MPI: the gradients (and extras) summed over ranks, on the device or the host
            self._sync()                 # (timing) the device's collectives are queued, not yet done
            t2 = time.perf_counter()
            graphs.run("update", key, self._update)
        figures = self.readout.tolist()   # waits for the step: the one read of a step
        t3 = time.perf_counter()
        if t1 is None or t2 is None:
            spent.compute = t3 - t0       # one graph: the step is one launch
        else:
            spent.compute, spent.allreduce, spent.optimizer = t1 - t0, t2 - t1, t3 - t2
        skipped = self.precision.skip(figures[EXTRA_OVERFLOW])   # the same on every rank, as the graph decided
        self.device_precision.refresh()
        result = self._result(figures, skipped, figures[AVERAGED_SQNORM], lambda: math.isfinite(figures[GRAD_SUM]),
                              spent)
        result.events.extend(self.graphs.events())
        return result

    # -- what the graphs hold -----------------------------------------------------------------

    @torch.no_grad()
    def _forward(self, static: StaticBatch) -> None:
        flat, extras = self.flat, self.flat.extras
        flat.buffer.zero_()
        with torch.enable_grad():
            stats = forward_backward(self.model, static.images, static.labels, self.normalize,
                                     self.device_precision)
        extras[EXTRA_LOSS: EXTRA_CORRECT + 1].copy_(stats)
        extras[EXTRA_SAMPLES].fill_(static.labels.numel())   # a graph is made for one batch shape
        extras[EXTRA_STOP].copy_(self.stop_flag)
        if self.precision.loss_scale is not None:
            self.device_precision.unscale(flat.grads, extras[EXTRA_OVERFLOW])
        if self.noise is not None:
            extras[EXTRA_SQNORM].copy_(squared_norm(flat.grads))   # before the allreduce: this rank's

    @torch.no_grad()
    def _update(self) -> None:
        extras, grads, readout = self.flat.extras, self.flat.grads, self.readout
        if self.precision.loss_scale is not None:
            self.found_inf.copy_(extras[EXTRA_OVERFLOW] > 0)   # 1: some rank overflowed, the fused step skips
        if self.noise is not None:
            readout[AVERAGED_SQNORM].copy_(squared_norm(grads))   # before the optimizer (Nesterov may change .grad)
        self.optimizer.step()
        readout[:EXTRAS].copy_(extras)
        readout[GRAD_SUM].copy_(grads.sum())

    def _whole_step(self, static: StaticBatch) -> None:
        self._forward(static)            # one rank: nothing to reduce
        self._update()

    # -- the strategy's state -------------------------------------------------------------------

    def global_state(self) -> dict[str, Any]:
        """As the eager step saves it: the rate a number, the optimizer's own flags (a run resumes either way)."""
        state = super().global_state()
        for group, (fused, foreach) in zip(state["optimizer"]["param_groups"], self._eager_flags):
            group.update(lr=float(group["lr"]), fused=fused, foreach=foreach)
        return state

    def load_state(self, shared: dict[str, Any], local: dict[str, Any] | None) -> list[str]:
        notes = super().load_state(shared, local)
        self._make_capturable()            # the loaded groups hold a number for the rate
        self._writes.forget()
        self.device_precision.refresh()
        self.graphs.reset("a checkpoint was loaded")   # the momentum buffers are new tensors
        return notes

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), "cuda_graphs": {"on": True, "rule": self.rule, **self.graphs.figures()}}

    def close(self) -> None:
        super().close()
        self.graphs.reset("closed")
        self.inputs.clear()
