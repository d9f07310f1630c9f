"""``DistributedGradients``: any ``nn.Module``'s gradients averaged over the ranks, overlapped with backward.

    comm, device = dimd.init()
    model = MyNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = dimd.DistributedGradients(model, optimizer=optimizer)   # broadcasts rank 0's weights
    for images, labels in loader.epoch(epoch):
        loss = F.cross_entropy(model(normalize(images)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()          # buckets are summed on the communication thread meanwhile;
        optimizer.step()         # when it returns, every .grad holds the average

What it does is :class:`dimd.train.buckets.GradientBuckets` (the same code
``dimd train``'s S-SGD step uses) over dimd's allreduce algorithms, plus what
a wrapper for a user's model needs: the first weights broadcast (after
checking that every rank built the same model), the algorithm chosen by
measurement, the MPI thread level checked, the end of each backward pass made
to wait for the average (as DDP: a script may clip or log ``.grad`` before
its step), batch-norm statistics averaged if asked.

On a GPU, backward ends on autograd's own thread, and :meth:`synchronize`
runs there: a device group's ``wait()`` makes that thread's current stream
wait for the reduction, not the stream a script steps on (``with
torch.cuda.stream(s)``). So an event is recorded there after the reduction,
and the stream current at the step waits on it (:class:`ReductionFence`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from dimd.allreduce import device_group
from dimd.errors import DimdError
from dimd.private_apis import graph_task_id
from dimd.stall import STALL_TIMEOUT_S, stall_timeout_problem, watch_job
from dimd.train.buckets import DEFAULT_BUCKET_MB, GradientBuckets


class DistributedGradients:
    """Average ``model``'s gradients over ``comm`` (default: COMM_WORLD) after every backward pass.

    ``algorithm``: a name of :data:`dimd.allreduce.ALGORITHMS`, or ``auto``
    (the fastest measured now for one bucket, among those needing only MPI);
    ``nccl`` (GPUs) and ``gloo`` (CPUs) start torch.distributed's group from
    ``comm`` (no MASTER_ADDR or MASTER_PORT to set) and reduce the buckets in
    place on the device, no host copy and no communication thread; ``torch``
    does the same on the group the caller initialised. ``bucket_mb``: bucket size (0: one
    bucket). ``overlap``: reduce each bucket on the communication thread as
    soon as backward completes it; False reduces them all as backward ends,
    with the same numbers. Either way ``backward()`` returns once every
    bucket is reduced (:meth:`synchronize` runs as autograd finishes).
    ``average``: divide the sum by the ranks (True, as DDP and Horovod).
    ``optimizer``: its ``step()`` calls :meth:`synchronize` first, which
    refuses a step inside :meth:`no_sync`. ``sync_buffers``: average
    floating-point buffers (batch-norm running statistics) over the ranks at
    every synchronize.
    ``stall_timeout``: a :meth:`synchronize` that waits this many seconds for the
    other ranks (a peer's node died or left the network) ends the job with one
    line instead of hanging it (:mod:`dimd.stall`); 0 waits for ever.
    ``options``: the algorithm's (``colors``, ``segment_bytes``).

    Collective: every rank constructs it with the same arguments, and runs the
    same number of synchronized backward passes.
    """

    def __init__(self, model: nn.Module, comm: Any = None, *, algorithm: str = "auto",
                 bucket_mb: float = DEFAULT_BUCKET_MB, overlap: bool = True, average: bool = True,
                 optimizer: torch.optim.Optimizer | None = None, sync_buffers: bool = False,
                 stall_timeout: float = STALL_TIMEOUT_S, **options: Any) -> None:
        from dimd.allreduce import STANDALONE, get_algorithm
        from dimd.train.sgd import broadcast_state

        problem = stall_timeout_problem(stall_timeout)
        if problem:
            raise DimdError(problem)
        if comm is None:
            comm = _world()
        if bucket_mb < 0:
            raise DimdError(f"bucket_mb must be 0 (one bucket) or more, got {bucket_mb}")
        if algorithm != "auto":
            get_algorithm(algorithm).resolve(options)   # the one-line error for a bad name or option
        device = next((p.device for p in model.parameters() if p.requires_grad), torch.device("cpu"))
        self.model = model
        self.comm = comm
        self.world_size = comm.Get_size()
        self.sync_buffers = sync_buffers
        if not any(p.requires_grad for p in model.parameters()):
            raise DimdError("DistributedGradients: the model has no trainable parameters")
        problem = _parameter_problem(model)
        if problem:
            raise DimdError(problem)
        broadcast_state(model, comm)   # MPI: every replica starts from rank 0's weights (the same model checked)
        bucket_bytes = int(bucket_mb * (1 << 20))
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.algorithm = (_fastest(min(bucket_bytes or trainable, trainable), comm, list(STANDALONE))
                          if algorithm == "auto" else algorithm)
        self.options = options
        # nccl, gloo: the group started now from MPI; torch: the caller's (a line when there is none)
        self.group = device_group(self.algorithm, comm, device, stall_timeout=stall_timeout)
        off_main = mpi_off_the_main_thread(self.group is not None, overlap, sync_buffers and self.world_size > 1,
                                           device)
        if off_main is not None:
            _check_thread_level(off_main)
        if get_algorithm(self.algorithm).point_to_point and self.world_size > 1:
            from dimd.allreduce.buffers import private_comm

            private_comm(comm)   # MPI: made now, on this thread, not first on the communication thread
        self.buckets = GradientBuckets(model.parameters(), self._reduce, self.world_size,
                                       bucket_bytes=bucket_bytes, overlap=overlap, average=average,
                                       device_reduce=self.group, at_backward_end=self.synchronize)
        self._step_hooks = ([optimizer.register_step_pre_hook(lambda *_: self.synchronize()),
                             optimizer.register_step_post_hook(lambda *_: self._consumed())]
                            if optimizer is not None else [])
        self._fence = ReductionFence(device_streams(device), device)
        # a backward pass that raised (and the script caught it) is dropped at the next forward
        self._forward_hook = model.register_forward_pre_hook(self._before_forward)
        self._steps = 0
        # MPI: a wait for the other ranks that outlasts `stall_timeout` (a peer's host is gone) ends the job
        self._watchdog = watch_job(comm, stall_timeout).__enter__()

    def _before_forward(self, *_: Any) -> None:
        """A forward outside backward while a backward pass is still open: that pass raised (and the script
        went on). Its step is dropped now, on every rank alike (:meth:`_drop_raised_pass`). Otherwise, where
        ``optimizer.zero_grad()`` set every ``.grad`` to None, they point into the zeroed buffer again, so
        backward writes the gradients where they are reduced (DDP copies each into its bucket)."""
        if graph_task_id() != -1:
            return   # a forward inside backward (activation checkpointing's recompute)
        if self.buckets.pass_open:
            self._drop_raised_pass()
        elif torch.is_grad_enabled():
            self.buckets.attach_if_released()

    def _drop_raised_pass(self) -> None:
        """End a backward pass that raised: reduce every bucket, then zero the gradients.

        The buckets it started are already in the other ranks' queue, and each
        rank started a different number of them (its own graph decides when a
        bucket is complete): reducing the rest in order, as the pass's end
        would have, pairs the collectives up again, whether the other ranks'
        passes raised too or ended. What was summed is partial, so it is
        dropped: every rank starts the next pass from zero gradients, with
        overlap or without.
        """
        syncing, self.buckets.syncing = self.buckets.syncing, True   # inside no_sync() too: the pass was not
        try:
            self._synchronize("the gradients' allreduce of a backward pass that raised")
        finally:
            self.buckets.syncing = syncing
        self.buckets.zero()
        self.buckets.reduced = True   # zeros, alike on every rank

    def _reduce(self, array: np.ndarray) -> None:
        from dimd.allreduce import allreduce

        allreduce(array, self.comm, self.algorithm, **self.options)   # MPI: the bucket summed over ranks

    @property
    def overlap(self) -> bool:
        return self.buckets.overlap

    def synchronize(self) -> None:
        """Collective: wait until every bucket is reduced (and averaged); then sync buffers if asked.

        Each synchronized backward pass runs it as it ends, so afterwards it
        does nothing until the next gradient comes, the optimizer passed in
        has stepped, or :meth:`zero_grad` ran (the optimizer calls it before
        each step; a Horovod-style loop calls it before clipping). So on a
        rank that ran no backward pass since the last step, it reduces what
        ``.grad`` holds (zeros after a ``zero_grad``), as the other ranks'
        backward passes do. Calling it inside :meth:`no_sync` is an error: the
        step would use this rank's gradients alone. On a GPU, the stream current
        where it is called (at the optimizer's step: the script's) waits for the
        reduction, wherever that ran.
        """
        if not self.buckets.syncing:
            raise DimdError("optimizer.step()/synchronize() inside no_sync(): the gradients were not "
                            "reduced; take the step after the block, on a backward pass outside it")
        if not self.buckets.reduced:   # else backward's end did it, and no gradient came since
            self._steps += 1
            self._synchronize(f"the gradients' allreduce of step {self._steps}")
        self._fence.wait()

    def _synchronize(self, what: str) -> None:
        with self._watchdog.waiting(what):
            self.buckets.synchronize()
            if self.sync_buffers and self.world_size > 1:
                average_buffers(self.model, self.comm)
        self._fence.reduced()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backward passes inside; the next one outside reduces the sum."""
        with self.buckets.no_sync():
            yield

    def zero_grad(self) -> None:
        """Zero the gradients in one pass over the flat buffer (``optimizer.zero_grad()`` works too,
        at the cost of copying each new gradient back into the buffer).

        Collective after a backward pass that raised: it drops that pass (:meth:`_drop_raised_pass`),
        so call it first in the ``except`` block, before any MPI call of the script's own.
        """
        if self.buckets.pass_open:
            self._drop_raised_pass()
            return
        self.buckets.zero()
        self.buckets.reduced = False

    def _consumed(self) -> None:
        """After the optimizer's step: the next synchronize() reduces whatever ``.grad`` holds then (zeros on
        a rank that runs no backward pass), as every other rank's backward pass does."""
        self.buckets.reduced = False

    def close(self) -> None:
        """Remove the hooks (the model trains locally again) and wait for the buckets still in flight."""
        for hook in [*self._step_hooks, self._forward_hook]:
            hook.remove()
        self._step_hooks = []
        if self.buckets.pass_open:   # the last backward pass raised
            self._drop_raised_pass()
        self.buckets.close()
        if self.group is not None:
            self.group.close()
        self._watchdog.__exit__()

    def describe(self) -> dict[str, Any]:
        """What was chosen, for a run's JSON."""
        return {"algorithm": self.algorithm, "buckets": self.buckets.buckets, "overlap": self.overlap,
                "gradient_bytes": self.buckets.flat.numel * 4,
                "reduced": f"on the device ({self.group.backend})" if self.group is not None else "over MPI"}


class ReductionFence:
    """On a GPU: an event recorded after each reduction, on the stream current where it ran (autograd's thread
    at backward's end), and the stream current at the step made to wait on it. ``streams`` is ``torch.cuda``
    (None: the CPU, where the reduction is done when it returns)."""

    def __init__(self, streams: Any, device: torch.device) -> None:
        self._streams = streams
        self._device = device
        self._event: Any = None

    def reduced(self) -> None:
        """After the reduction was queued (and waited for) on this thread's current stream."""
        if self._streams is not None:
            self._event = self._streams.Event()
            self._event.record(self._streams.current_stream(self._device))

    def wait(self) -> None:
        """The stream current here waits for the last reduction (the host does not)."""
        if self._event is not None:
            self._streams.current_stream(self._device).wait_event(self._event)


def device_streams(device: torch.device) -> Any:
    """Where ``device``'s streams and events are: ``torch.cuda`` on a GPU, None on the CPU."""
    return torch.cuda if device.type == "cuda" else None


def average_buffers(model: nn.Module, comm: Any) -> None:
    """Collective: floating-point buffers (batch-norm running mean and variance) averaged over ranks."""
    from mpi4py import MPI

    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for b in buffers]).numpy()
    comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)   # MPI: every rank's statistics
    flat /= comm.Get_size()
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(torch.from_numpy(flat[offset: offset + b.numel()]).view_as(b))
            offset += b.numel()


def _parameter_problem(model: nn.Module) -> str | None:
    """Why the trainable parameters cannot share one float32 gradient buffer on one device, or None."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    device = trainable[0][1].device
    for name, p in trainable:
        if p.dtype != torch.float32 or p.device != device or p.layout != torch.strided:
            return (f"DistributedGradients reduces dense float32 parameters on one device; {name} is {p.dtype} "
                    f"on {p.device} (keep the weights in float32 and compute in bf16 or float16 under "
                    f"torch.autocast)")
    return None


def _world() -> Any:
    from dimd.mpi import init_mpi

    init_mpi("serialized")   # a no-op after dimd.init()
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _fastest(nbytes: int, comm: Any, candidates: list[str]) -> str:
    if comm.Get_size() == 1:
        return "mpi"
    from dimd.allreduce import choose_fastest

    return choose_fastest(nbytes, comm, np.float32, candidates)   # MPI: timed on every rank alike


def mpi_off_the_main_thread(device_group: bool, overlap: bool, sync_buffers: bool,
                            device: torch.device) -> str | None:
    """Why this wrapper calls MPI from a thread other than the caller's, and how to avoid it; or None.

    The communication thread reduces the host path's buckets; on a GPU, autograd ends backward on a thread
    of its own, and :meth:`DistributedGradients.synchronize` runs there: the host path's sum, or the buffers'
    average even where a device group reduces the gradients.
    """
    if not device_group and overlap:
        return "overlap=True reduces on a communication thread (or pass overlap=False)"
    if device.type != "cpu" and not device_group:
        return "on a GPU, backward ends on autograd's thread, and the gradients' allreduce calls MPI there"
    if device.type != "cpu" and sync_buffers:
        return ("on a GPU, backward ends on autograd's thread, and sync_buffers=True averages the buffers over MPI "
                "there (or pass sync_buffers=False)")
    return None


def _check_thread_level(why: str) -> None:
    """A thread other than the caller's calls MPI (``why``): SERIALIZED at least, else one line."""
    from mpi4py import MPI

    provided = MPI.Query_thread()
    if provided < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled"}
        raise DimdError(f"MPI is initialised at {names.get(provided, provided)}, and {why}: that needs "
                        f"THREAD_SERIALIZED or MULTIPLE; call dimd.init() before anything imports mpi4py.MPI")
