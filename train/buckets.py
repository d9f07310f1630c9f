"""Gradient buckets reduced while backward still runs (PyTorch DDP's reducer, Horovod's hooks).

The trainable parameters' gradients live in one :class:`FlatGradients` buffer
laid out in *reverse* parameter order, because backward produces the last
layers' gradients first. The buffer is cut into buckets at parameter ends.
A hook on every parameter (``register_post_accumulate_grad_hook``) counts the
gradients of its bucket; when a bucket is complete, and every bucket before
it has been started, it goes to the one communication thread, which sums it
across ranks with the caller's ``reduce`` and averages it, while autograd
goes on with earlier layers. :meth:`GradientBuckets.synchronize` starts what
is left (buckets holding parameters that got no gradient this step, the
extras tail), waits for the thread, and re-raises what it raised.

Why one thread, in bucket order: every rank must issue the same collectives
in the same order, whatever its own backward did (an unused branch, a frozen
layer on one rank only). A bucket is therefore never started before the ones
in front of it, and a single thread runs them one after another. The thread
is one per process, shared by every ``GradientBuckets``: two wrapped models
in one backward pass (a GAN's generator step reaches the discriminator too)
would otherwise call MPI from two threads at once, which ``THREAD_SERIALIZED``
forbids. And while two wrappers (``at_backward_end``) are alive, neither
starts a bucket during backward: each rank completes their buckets in its own
order (an unused branch on one rank holds one wrapper's bucket back), so the
wrappers are reduced one after the other at the pass's end, in the order they
were made. Why a
thread and not ``MPI_Iallreduce``: a non-blocking collective only advances
inside MPI calls (MPICH's asynchronous progress is off by default), and
dimd's own algorithms are point-to-point Python loops that need a caller
anyway; bench/probes/overlap.py measures the two (docs/library.md).

``overlap=False`` reduces the same buckets with the same code, in the same
order, on the caller's thread at :meth:`synchronize`: the sums are the same
numbers, so the weights after N steps are identical with and without it.

**On the device** (``device_reduce``, a :class:`DeviceReduce`: the
torch.distributed group of :mod:`dimd.allreduce.group`, NCCL on GPUs and gloo
on CPUs) there is no host copy and no communication thread: the hook that
completes a bucket starts its collective at once, in place on the buffer's
slice, and returns (``all_reduce(async_op=True)``, as DDP's reducer does). The
backend runs it on a stream of its own (NCCL: it waits there for what the
compute stream queued before the call, so the bucket's gradients are written,
while backward goes on) or on its own threads (gloo).
:meth:`synchronize` then waits for each bucket in order: on a GPU the
compute stream waits (the host does not), on a CPU the caller does. The mean
is taken in the collective where the backend can (NCCL's ``AVG``); the extras
in the last bucket are multiplied by the ranks first, so the mean leaves them
summed. The rules of order are the host path's: buckets start in index order,
the extras' bucket at :meth:`synchronize`, none during backward while two
wrappers are alive.

``at_backward_end`` (what :class:`dimd.DistributedGradients` passes: its
synchronize) is queued with autograd on the first gradient of each
synchronized backward pass, so it runs as ``backward()`` finishes, as DDP's
reducer does: every ``.grad`` then holds the average when ``backward()``
returns, before the caller clips, logs or steps.
"""

from __future__ import annotations

import bisect
import contextlib
import queue
import threading
import weakref
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np
import torch

from dimd.errors import DimdError
from dimd.private_apis import at_backward_end, graph_task_id
from dimd.train.flatgrad import FlatGradients, Reduce

#: Why a gradient from an enclosing backward pass, after a nested one ended, is refused.
_NESTED_PASS = ("a backward pass nested in another (activation checkpointing with use_reentrant=True) gave the "
                "first gradients and ended, so they were averaged before the enclosing pass gave the rest; "
                "checkpoint with use_reentrant=False")


class BucketInFlight(Protocol):
    """A bucket's collective in flight."""

    def wait(self) -> None:
        """Make the result visible to what the caller does next: on a GPU, the caller's current stream waits
        for it (the host does not); on a CPU, the caller's thread waits."""


class DeviceReduce(Protocol):
    """What reduces buckets in place where they are (:class:`dimd.allreduce.TorchGroup`: NCCL, gloo).

    ``start`` is called in bucket order, on the thread that runs backward (on a
    GPU, autograd's), with a contiguous 1-D slice of the flat buffer: it
    starts summing it over the ranks (``average``: their mean) and returns at
    once; the backend orders the collective after the work already queued
    on the caller's stream. Every rank calls it with the same slices in the
    same order.
    """

    def start(self, tensor: torch.Tensor, average: bool = False) -> BucketInFlight:
        ...

#: The bucket when overlapping and none is asked for: big enough that per-message costs stay small,
#: small enough that the first bucket is ready early in backward (DDP's default is 25 MiB too).
DEFAULT_BUCKET_MB = 25.0
#: On the device path the first bucket (the last layers') is cut at about this size (DDP's rule), so its
#: collective starts while most of backward is still to run; the host path keeps whole buckets, its
#: thread's Python work would compete with backward for the interpreter (docs/library.md).
FIRST_BUCKET_BYTES = 1 << 20


def core_free_for_communication(device: torch.device, comm: Any) -> bool:
    """Whether overlap can hide anything here: the compute runs on a GPU, or the node has a core beyond
    its ranks' torch threads for the communication thread (measured in docs/library.md: without one,
    the thread and backward share the cores and nothing is hidden). Collective over ``comm``."""
    if device.type == "cuda":
        return True
    from dimd.host import available_cores
    from dimd.mpi import node_local_ranks

    return available_cores() > node_local_ranks(comm) * torch.get_num_threads()   # MPI: ranks on this node


class CommunicationThread:
    """The one thread per process that runs every bucket's reduction, in the order they are submitted."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Future[None]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="dimd-allreduce", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> Future[None]:
        done: Future[None] = Future()
        self._queue.put((work, done))
        return done

    def drain(self) -> None:
        """Wait until everything submitted so far has run (before the caller's own thread calls MPI)."""
        self.submit(lambda: None).result()

    def _serve(self) -> None:
        while True:
            work, done = self._queue.get()
            try:
                work()
            except BaseException as exc:  # handed to the caller's thread at synchronize()
                done.set_exception(exc)
            else:
                done.set_result(None)


_communication: CommunicationThread | None = None
_communication_lock = threading.Lock()


def communication_thread() -> CommunicationThread:
    """This process's communication thread, started on first use."""
    global _communication
    with _communication_lock:
        if _communication is None:
            _communication = CommunicationThread()
        return _communication


#: The live buckets that end each backward pass themselves (``at_backward_end``), in the order they were made.
_wrappers: list[weakref.ref[GradientBuckets]] = []


def _live_wrappers() -> list[GradientBuckets]:
    return [b for b in (ref() for ref in _wrappers) if b is not None]


class GradientBuckets:
    """The gradients of ``parameters`` in buckets of about ``bucket_bytes``, summed (and averaged) over ranks.

    ``reduce`` sums a contiguous float32 numpy array in place across the job
    (on a GPU, a pinned host copy of the bucket); ``device_reduce``, if given,
    reduces the buffer's slices where they are instead (no host copy, no
    communication thread). ``first_bucket_bytes``: the first bucket's size
    (None: :data:`FIRST_BUCKET_BYTES` with ``device_reduce`` and ``overlap``,
    else a whole bucket; 0: a whole bucket). ``extras`` scalars after the gradients ride in the
    last bucket, which therefore starts only at :meth:`synchronize` (the
    caller fills them after backward); they are summed, never averaged.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], reduce: Reduce, world_size: int, *,
                 extras: int = 0, bucket_bytes: int = 0, overlap: bool = True, average: bool = True,
                 device_reduce: DeviceReduce | None = None, first_bucket_bytes: int | None = None,
                 at_backward_end: Callable[[], None] | None = None) -> None:
        trainable = [p for p in parameters if p.requires_grad]
        if first_bucket_bytes is None:
            first_bucket_bytes = FIRST_BUCKET_BYTES if device_reduce is not None and overlap else 0
        self.flat = FlatGradients(reversed(trainable), extras=extras, bucket_bytes=bucket_bytes,
                                  first_bucket_bytes=first_bucket_bytes, host_copy=device_reduce is None)
        self.parameters = self.flat.parameters   # in buffer order: last layer first
        self.reduce = reduce
        self.device_reduce = device_reduce
        self.world_size = world_size
        self.overlap = overlap
        self.average = average and world_size > 1
        self.syncing = True
        self.at_backward_end = at_backward_end
        #: Whether the gradients were reduced and none came since: a second synchronize() would sum them again.
        self.reduced = False
        self.bounds = self.flat.bucket_bounds
        starts = [start for start, _ in self.bounds]
        self.bucket_of = [bisect.bisect_right(starts, int(offset)) - 1 for offset in self.flat.offsets]
        self.sizes = [self.bucket_of.count(b) for b in range(len(self.bounds))]
        self.sizes[-1] += 1 if extras else 0   # the extras: released by synchronize()
        self._views = [self.flat.buffer[int(o): int(o) + p.numel()].view_as(p)
                       for p, o in zip(self.parameters, self.flat.offsets)]
        self._host = self.flat._host is not self.flat.buffer
        self._slices = [self.flat.buffer[start:stop] for start, stop in self.bounds]
        self._events: dict[int, torch.cuda.Event] = {}
        self._started: list[Future[None]] = []   # this pass's buckets on the communication thread
        self._in_flight: list[BucketInFlight] = []      # ... or on the device_reduce's stream or threads
        self._pass_task = -1    # autograd's id of the backward pass at_backward_end is queued with
        self._ended_task = -1   # ... and of the last one that ended (ids grow: a lower one is an enclosing pass)
        self._failed = False   # a bucket's reduction raised: the later ones of the pass are skipped
        self._early = True     # buckets start during backward (no other wrapper alive at the pass's start)
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._on_gradient, i))
                       for i, p in enumerate(self.parameters)]
        if at_backward_end is not None:
            _wrappers.append(weakref.ref(self))

    @property
    def buckets(self) -> int:
        return len(self.bounds)

    @property
    def pass_open(self) -> bool:
        """Whether a synchronized backward pass gave gradients and its end has not come yet."""
        return self._end_queued

    def _reset(self) -> None:
        self._pending = list(self.sizes)
        self._ready = [False] * len(self.parameters)
        self._next = 0   # the next bucket to start; every rank starts them in this order
        self._end_queued = False   # at_backward_end is queued with the backward pass now running

    # -- during backward ------------------------------------------------------------------

    def _on_gradient(self, index: int, parameter: torch.nn.Parameter) -> None:
        """Autograd finished ``parameter``'s gradient for this backward pass."""
        view = self._views[index]
        grad = parameter.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)          # zero_grad(set_to_none=True) replaced it: back into the buffer
            parameter.grad = view
        self.reduced = False   # a new gradient (inside no_sync too): what a synchronize() would sum changed
        if not self.syncing:
            return
        if self.at_backward_end is not None and not self._end_queued:   # this backward pass's first gradient
            task = graph_task_id()
            if task < self._ended_task:
                raise DimdError(_NESTED_PASS)
            self._end_queued = True
            self._pass_task = task
            self._early = len(_live_wrappers()) == 1   # else the pass's end reduces the wrappers, in a fixed order
            at_backward_end(self._backward_ended)
        if not self.overlap or not self._early:
            return
        if self._ready[index]:
            raise RuntimeError("a second backward pass reached a gradient whose bucket is already being "
                               "reduced; call step()/synchronize() after each backward, or run the "
                               "accumulation passes inside no_sync()")
        self._ready[index] = True
        bucket = self.bucket_of[index]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._start_ready()

    def _backward_ended(self) -> None:
        """As the pass ends: every wrapper it reached, in the order they were made (the same on every rank)."""
        for buckets in _live_wrappers():
            if buckets._end_queued and buckets._pass_task == self._pass_task:   # reached by this pass, not ended
                buckets._ended_task = buckets._pass_task
                assert buckets.at_backward_end is not None
                buckets.at_backward_end()

    def _start_ready(self) -> None:
        """Start every complete bucket from the next one on, stopping at the first incomplete one."""
        while self._next < len(self.bounds) and self._pending[self._next] == 0:
            self._start(self._next)
            self._next += 1

    def _start(self, bucket: int) -> None:
        if self.device_reduce is not None:
            self._start_on_device(bucket)
            return
        if not self.overlap:
            self._reduce_bucket(bucket)
            return
        if self.flat.buffer.is_cuda:   # the bucket's gradients are queued on the stream, not yet written
            event = torch.cuda.Event()
            event.record()
            self._events[bucket] = event
        self._started.append(communication_thread().submit(partial(self._reduce_started, bucket)))

    def _start_on_device(self, bucket: int) -> None:
        """Start the bucket's collective where the buffer is, without waiting for it."""
        if self.world_size == 1:
            return   # the sum over one rank is the bucket
        assert self.device_reduce is not None
        extras = self.bounds[bucket][1] - self.flat.numel
        if self.average and extras > 0:   # the extras ride here: times the ranks, so the mean is their sum
            self.flat.extras.mul_(self.world_size)
        self._in_flight.append(self.device_reduce.start(self._slices[bucket], self.average))   # MPI: the bucket

    def _reduce_started(self, bucket: int) -> None:
        """On the communication thread: one bucket, unless an earlier one of this pass failed."""
        if self._failed:
            return
        try:
            self._reduce_bucket(bucket)
        except BaseException:
            self._failed = True
            raise

    def _reduce_bucket(self, bucket: int) -> None:
        start, stop = self.bounds[bucket]
        flat = self.flat
        event = self._events.pop(bucket, None)
        if self.world_size == 1:
            return   # the sum over one rank is the bucket: on a GPU this skips its copy to the host and back
        if event is not None:
            event.synchronize()
        assert flat.host_array is not None   # made with a host copy: no device_reduce
        if self._host:
            flat._host[start:stop].copy_(flat.buffer[start:stop])
        self.reduce(flat.host_array[start:stop])   # MPI: the bucket summed over ranks
        if self.average:
            grads = flat.host_array[start:min(stop, flat.numel)]
            np.divide(grads, self.world_size, out=grads)
        if self._host:
            flat.buffer[start:stop].copy_(flat._host[start:stop])

    # -- after backward -------------------------------------------------------------------

    def synchronize(self) -> None:
        """Collective: every bucket reduced and averaged, every ``.grad`` pointing into the buffer.

        Parameters that got no gradient since the last call reduce as zeros
        (their ``.grad`` is set), so every rank takes the same optimizer step.
        Inside :meth:`no_sync` this does nothing.
        """
        if not self.syncing:
            return
        try:
            for view, parameter in zip(self._views, self.parameters):
                grad = parameter.grad
                if not parameter.requires_grad:   # frozen since: reduced as zeros, and no .grad to step with
                    view.zero_()
                    parameter.grad = None
                elif grad is None or grad.data_ptr() != view.data_ptr():
                    if grad is None:
                        view.zero_()
                    else:
                        view.copy_(grad)
                    parameter.grad = view
            if not self.overlap and self.device_reduce is None:
                _drain_other_reductions()
            self._pending = [0] * len(self.bounds)
            self._start_ready()
            self._wait_started()
            self.reduced = True
        finally:
            self._reset()

    def _wait_started(self) -> None:
        """Wait for this pass's buckets (on the communication thread, or on the device); re-raise the first error."""
        in_flight, self._in_flight = self._in_flight, []
        for pending in in_flight:
            pending.wait()   # MPI: the bucket's collective, in start order
        started, self._started = self._started, []
        errors = [error for error in (done.exception() for done in started) if error is not None]
        self._failed = False
        if errors:
            raise errors[0]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synchronized one reduces the sum."""
        before, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = before

    def zero(self) -> None:
        """Zero every gradient in one pass (and point any replaced ``.grad`` back into the buffer)."""
        self.flat.zero()
        self.flat.attach()

    def attach_if_released(self) -> bool:
        """Before a forward pass: where every ``.grad`` was set to None (``zero_grad(set_to_none=True)``, the
        optimizer's default), zero the buffer in one pass and point them back into it, so that backward adds
        into the buffer in place instead of into new tensors each hook would copy back. Whether it did."""
        if any(p.grad is not None for p in self.parameters):
            return False
        self.zero()
        return True

    def close(self) -> None:
        """Remove the hooks and wait for the buckets still being reduced."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        _wrappers[:] = [ref for ref in _wrappers if ref() not in (None, self)]
        with contextlib.suppress(BaseException):
            self._wait_started()


def _drain_other_reductions() -> None:
    """Before this thread calls MPI: wait for what other buckets gave the communication thread, so the two
    never call MPI at once and every rank issues the collectives in one order."""
    if _communication is not None:
        _communication.drain()
