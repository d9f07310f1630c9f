"""The training step as CUDA graphs: captured once over static device tensors, replayed every step.

At a small batch per GPU a step is hundreds of short kernels, each launched from Python, and the
launches, not the GPU, set the pace. A CUDA graph records the kernels of a step once and replays
them with one launch. What that takes, and how dimd keeps a replayed step the same as an eager one:

* **Static tensors.** A graph reads and writes the addresses it was captured with. A batch is
  copied into the step's static inputs (:class:`StaticBatch`) on the compute stream before the
  replay (the device feed still stages batches ahead on its own stream); weights, gradients (flat
  buffers), momentum and batch-norm statistics live for the whole run and change in place.
* **Nothing that changes is baked in.** The learning rate, the stop flag and 16-mixed's loss
  scale are device tensors the host writes before a replay (:class:`ScalarWrites`: a kernel with
  the value as its argument, no copy from host memory to race with); the overflow check and the
  skip of an overflowed step run on the device; the figures the host needs come back in one
  small read per step.
* **Warm-up.** A new graph's first :data:`WARMUP_STEPS` steps run eagerly on a side stream (cuBLAS
  workspaces, cuDNN's choices and autograd's threads are set up lazily and must not be set up
  inside a capture); the next step is captured on that stream and replayed. The warm-up steps
  are real steps of the run: nothing is computed twice or thrown away.
* **One graph per input shape** (a last batch of another size gets its own), at most
  :data:`MAX_SHAPES`; a shape beyond them runs eagerly and says so once. Every capture is
  recorded (:class:`CaptureRecord`: which graph, why, at which step, its seconds and the memory
  its pool holds) and lands in the run's JSON; nothing is re-captured silently, and a step
  never re-captures a shape it already holds.
* **Nothing else on the device during a capture.** The device feed (and nvJPEG under ``--decode gpu``)
  pauses while any graph is captured: the capture holds :data:`dimd.shuffle.device_feed.DEVICE_WORK`,
  which the feed holds around each batch's device work. Capture mode ``thread_local``.
* **A capture that fails** (a model that reads a device value on the host: ``.item()``, ``nonzero``, a
  boolean mask) ends cleanly. With graphs on by default (``fallback``) that step and the rest of the
  run run eagerly, the reason is said in one line and recorded in the JSON; with ``--cuda-graphs``
  asked for, it is an error naming the operation (:class:`CaptureFailed`), raised before the step
  changed anything, so a resume continues from the last checkpoint.
* **Each graph's own memory pool and random numbers.** A reset takes a new pool handle (the old pool is
  still held by tensors of the old captures); a graph that runs beside others (SMA's learners on
  their streams) reads its own generator state, registered with it (:class:`RandomStream`).

Off a GPU, :class:`StandIn` plays the graph: its "capture" runs the step function once, refusing what
a CUDA capture refuses (an operation that reads a device value on the host), and its "replay" calls
it again, so the bookkeeping above runs through the same code on the CPU and is tested there against
the plain eager step (``tests/test_graphs.py``).

When graphs are on by default, and what they cannot go with, is :mod:`dimd.train.rules`'s.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Hashable, Iterator, Protocol, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dimd.errors import DimdError
from dimd.shuffle.device_feed import DEVICE_WORK
from dimd.train.batchnorm import BATCH_NORMS

#: Eager steps of a new graph before it is captured (PyTorch's own examples warm up for 3).
WARMUP_STEPS = 3

#: Input shapes a step keeps graphs for; a further shape runs eagerly (its step is said once).
MAX_SHAPES = 4

#: The CUDA capture mode: other threads (the device feed) may keep issuing work while one thread captures.
CAPTURE_MODE = "thread_local"


def capture_problem(model: nn.Module) -> str | None:
    """Why ``model``'s training step cannot be captured (one line), or None.

    Batch norm with ``momentum=None`` (a cumulative average) reads its step count on the host at every
    step, which a replay would never do again.
    """
    for name, module in model.named_modules():
        if isinstance(module, BATCH_NORMS) and module.track_running_stats \
                and module.momentum is None:
            return (f"batch norm {name or type(module).__name__} has momentum=None (a cumulative average it reads "
                    f"on the host at every step), which a CUDA graph cannot replay")
    return None


class StaticBatch:
    """A graph's input tensors for one batch shape; each batch is copied into them on the compute stream."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device) -> None:
        self.images = torch.empty(images.shape, dtype=images.dtype, device=device)
        self.labels = torch.empty(labels.shape, dtype=labels.dtype, device=device)

    def load(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """The batch into the static tensors (nothing to copy if it already is them)."""
        for static, given in ((self.images, images), (self.labels, labels)):
            if given.data_ptr() != static.data_ptr():
                static.copy_(given, non_blocking=True)


def batch_key(images: torch.Tensor, labels: torch.Tensor) -> tuple:
    """What a graph's static inputs are made for: the batch's shapes and types."""
    return tuple(images.shape), images.dtype, tuple(labels.shape), labels.dtype


class StaticInputs:
    """The static batches of one step (one per learner), by input shape."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_key: dict[Hashable, list[StaticBatch]] = {}

    def load(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Hashable, list[StaticBatch]]:
        """Copy ``batches`` into the static batches of their shape; returns the shape's key and them."""
        key = tuple(batch_key(images, labels) for images, labels in batches)
        statics = self._by_key.get(key)
        if statics is None:
            statics = self._by_key[key] = [StaticBatch(images, labels, self.device) for images, labels in batches]
        for static, (images, labels) in zip(statics, batches):
            static.load(images, labels)
        return key, statics

    def clear(self) -> None:
        self._by_key.clear()


class RandomStream:
    """One learner's own random numbers (its dropout masks): apart from the other learners', the same again
    for the same seed, eager or replayed.

    Learners replayed at once on several streams must not share the default generator: each replay
    refreshes the generator's seed and offset on its own stream, so concurrent replays race on them.
    On a GPU the stream is a clone of the device's generator state, made the default while the
    learner's body runs (``graphsafe_set_state``) and registered with each graph that captures it; on
    the CPU it is a state of the default generator, swapped in around the body.
    """

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = torch.device(device)
        self.cuda_state: Any = None    # on a GPU: a clone of the device generator's state
        self.cpu_state: torch.Tensor | None = None   # on the CPU: the default generator's state, as bytes
        if self.device.type == "cuda":
            generator = torch.cuda.default_generators[self.device.index or torch.cuda.current_device()]
            self.cuda_state = generator.clone_state()
            self.cuda_state.manual_seed(seed)
            self._default = generator
        else:
            self.cpu_state = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The default generator draws from this stream inside."""
        if self.device.type == "cuda":
            previous = self._default.graphsafe_get_state()
            self._default.graphsafe_set_state(self.cuda_state)
            try:
                yield
            finally:
                self._default.graphsafe_set_state(previous)
            return
        assert self.cpu_state is not None
        saved = torch.get_rng_state()
        torch.set_rng_state(self.cpu_state)
        try:
            yield
        finally:
            self.cpu_state = torch.get_rng_state()
            torch.set_rng_state(saved)

    def register(self, graph: Any) -> None:
        """Have ``graph`` refresh this state's seed and offset at each replay (CUDA)."""
        graph.register_generator_state(self.cuda_state)


class CaptureFailed(DimdError):
    """A step's capture failed where graphs were asked for (``--cuda-graphs``): the step did not run."""


def refused_by_capture(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it arose from) is CUDA's or PyTorch's refusal of an operation in a capture."""
    seen: BaseException | None = exc
    while seen is not None:
        if "captur" in str(seen).lower():
            return True
        seen = seen.__context__
    return False


def capture_failure(exc: BaseException) -> str:
    """Why a capture failed, in one line: CUDA's words and, where the traceback has it, the line of the
    model (or other code outside torch and dimd) that read a device value on the host."""
    original = exc
    while original.__context__ is not None and CAPTURE_REFUSAL not in str(original):
        original = original.__context__   # capture_end's own error hides the operation's
    message = str(original).strip().splitlines()[0] if str(original).strip() else type(original).__name__
    inside = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(original.__traceback__) if not f.filename.startswith(inside)]
    if frames:
        where = frames[-1]
        message += f", at {where.filename}:{where.lineno} ({(where.line or '').strip()})"
    return message


# -- capturing and replaying --------------------------------------------------------------------


class Replayable(Protocol):
    def replay(self) -> None: ...


class Backend(Protocol):
    """Where steps are captured and replayed: :class:`CudaBackend`, or the CPU's :class:`StandIn`."""

    name: str

    def eager(self, body: Callable[[], None]) -> None:
        """Run ``body`` as a warm-up step."""

    def capture(self, body: Callable[[], None],
                randoms: Sequence[RandomStream] = ()) -> tuple[Replayable, int]:
        """Capture ``body`` (which reads the generator states of ``randoms``); the graph and the device
        memory its capture took."""

    def new_pool(self) -> None:
        """Capture into a fresh memory pool from now on (the old one may still be held by old graphs' tensors)."""


class CudaBackend:
    """Capture on a side stream of its own, into a memory pool of its own (or ``pool``, shared with graphs
    that are never replayed at the same time); replays run on the caller's current stream."""

    name = "cuda"

    def __init__(self, device: torch.device, stream: Any = None, *, share_pool: bool = True) -> None:
        self.device = torch.device(device)
        self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
        # Graphs of one step (its shapes, its parts) run one after another on one stream: one pool serves
        # them all (PyTorch's "sharing memory across captures").
        self.share_pool = share_pool
        self.pool = torch.cuda.graph_pool_handle() if share_pool else None

    def eager(self, body: Callable[[], None]) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            body()
        current.wait_stream(self.stream)

    def capture(self, body: Callable[[], None],
                randoms: Sequence[RandomStream] = ()) -> tuple[Replayable, int]:
        graph = torch.cuda.CUDAGraph()
        for random in randoms:
            random.register(graph)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        # What torch.cuda.graph does first (wait, release the cache): the allocator's growth across the
        # capture is then the memory the graph's pool took (less, where it reuses a shared pool's blocks).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode=CAPTURE_MODE):
            body()
        current.wait_stream(self.stream)
        return graph, max(0, torch.cuda.memory_reserved(self.device) - before)

    def new_pool(self) -> None:
        if self.share_pool:
            self.pool = torch.cuda.graph_pool_handle()


class _Kept:
    """The stand-in's "graph": the step function, called at every replay but the first (its capture ran it)."""

    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body
        self.captured_run = True

    def replay(self) -> None:
        if self.captured_run:
            self.captured_run = False
            return
        self.body()


#: What a CUDA capture refuses, as CUDA says it (the stand-in says it too).
CAPTURE_REFUSAL = "CUDA error: operation not permitted when stream is capturing"

#: Operations that read a device value on the host (a device-to-host copy and a wait), which no capture can record.
_HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default",
                         "aten.masked_select.default", "aten.equal.default", "aten._unique2.default",
                         "aten.unique_consecutive.default"})


class _RefuseHostReads(TorchDispatchMode):
    """The stand-in's capture: each operation that would read a device value on the host raises as CUDA's would."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        boolean_index = name.startswith("aten.index.") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ())
        if name in _HOST_READS or boolean_index:
            raise RuntimeError(f"{CAPTURE_REFUSAL} ({name} reads a device value on the host)")
        return func(*args, **(kwargs or {}))


class StandIn:
    """Graphs off a GPU: "capture" runs the step function once, refusing what a CUDA capture refuses, and
    "replay" calls it again, eagerly.

    The bookkeeping around a graph (static inputs, the scalars written before a replay, warm-up,
    shapes, records, a capture that fails) then runs through the same code on the CPU, where tests
    compare it with the plain eager step. A CUDA capture records without running, so a capture that
    fails has changed nothing; the stand-in ran what came before the refused operation. It measures
    nothing: its records hold no seconds or bytes worth reading.
    """

    name = "stand-in"

    def __init__(self) -> None:
        self.pools = 1       # memory pools it was given (a CUDA backend takes a new one at every reset)

    def eager(self, body: Callable[[], None]) -> None:
        body()

    def capture(self, body: Callable[[], None],
                randoms: Sequence[RandomStream] = ()) -> tuple[Replayable, int]:
        with _RefuseHostReads():
            body()
        return _Kept(body), 0

    def new_pool(self) -> None:
        self.pools += 1


def backend_for(device: torch.device, stream: Any = None, *, share_pool: bool = True) -> Backend:
    """The CUDA backend on a GPU; a :class:`StandIn` anywhere else (tests)."""
    if torch.device(device).type == "cuda":
        return CudaBackend(device, stream, share_pool=share_pool)
    return StandIn()


# -- the records ------------------------------------------------------------------------------


@dataclass
class CaptureRecord:
    """One capture, as the run's JSON lists it."""

    graph: str            # which part of the step ("step", "forward", "update", "learners", "learner 2", "sync")
    shape: str            # the input shape it was captured for
    reason: str           # why: the first capture, a new shape, learners changed, state loaded...
    step: int             # the strategy's step count when it was captured (1-based)
    seconds: float        # the capture itself, instantiation included
    pool_bytes: int       # device memory the allocator gained across the capture (the graph's pool)


@dataclass
class CaptureFailure:
    """The capture that failed, where graphs fell back to eager steps (the run's JSON)."""

    graph: str            # which part of the step
    shape: str            # the input shape it was captured for
    step: int             # the strategy's step count (1-based): this step ran eagerly, and every later one
    reason: str           # CUDA's words, and the line that read a device value on the host


@dataclass
class _Entry:
    warmups: int = 0
    graph: Replayable | None = None
    pool_bytes: int = 0


class StepGraphs:
    """The graphs of one strategy's step, by part and input shape: warm-up, capture, replay, records."""

    def __init__(self, backend: Backend, *, warmup: int = WARMUP_STEPS, max_shapes: int = MAX_SHAPES,
                 fallback: bool = False) -> None:
        self.backend = backend
        self.warmup = warmup
        self.max_shapes = max_shapes
        self.fallback = fallback      # a failed capture runs eagerly from then on (graphs on by default)
        self.failed: CaptureFailure | None = None
        self.captures: list[CaptureRecord] = []
        self.replays = 0
        self.eager_runs = 0
        self.steps = 0
        self._entries: dict[str, dict[Hashable, _Entry]] = {}   # part -> input key -> its graph (or warm-up)
        self._captured_parts: set[str] = set()   # since the last reset
        self._reset_reason: str | None = None
        self._events: list[str] = []
        self._said_too_many = False

    def begin_step(self) -> None:
        """A new step of the strategy (the records count steps)."""
        self.steps += 1

    def run(self, part: str, key: Hashable, body: Callable[[], None], backend: Backend | None = None,
            randoms: Sequence[RandomStream] = ()) -> str:
        """This step's ``part`` for inputs ``key``: eager while it warms up, then captured once and replayed
        (``randoms``: the generator states ``body`` draws from, registered with its graph).

        Returns what happened: "eager", "captured" (and replayed) or "replayed".
        """
        backend = backend or self.backend
        if self.failed is not None:   # a capture failed: the rest of the run is eager, on the current stream
            self.eager_runs += 1
            body()
            return "eager"
        entries = self._entries.setdefault(part, {})
        entry = entries.get(key)
        if entry is None:
            if len(entries) >= self.max_shapes:
                if not self._said_too_many:
                    self._said_too_many = True
                    self._events.append(f"CUDA graphs: batch shape {describe(key)} runs eagerly, as will any further "
                                        f"shape (graphs are kept for {self.max_shapes} shapes)")
                self.eager_runs += 1
                backend.eager(body)
                return "eager"
            entry = entries[key] = _Entry()
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
            return "replayed"
        if entry.warmups < self.warmup:
            entry.warmups += 1
            self.eager_runs += 1
            backend.eager(body)
            return "eager"
        t0 = time.perf_counter()
        try:
            with DEVICE_WORK:   # the device feed pauses while the graph is captured
                entry.graph, entry.pool_bytes = backend.capture(body, randoms)
        except Exception as exc:
            if not refused_by_capture(exc):
                raise   # an error of the step itself, not of its capture
            return self._capture_failed(part, key, body, exc)
        seconds = time.perf_counter() - t0
        self.captures.append(CaptureRecord(part, describe(key), self._reason(part), self.steps, seconds,
                                           entry.pool_bytes))
        entry.graph.replay()
        self.replays += 1
        return "captured"

    def _capture_failed(self, part: str, key: Hashable, body: Callable[[], None], exc: Exception) -> str:
        """A capture failed: with ``fallback``, this step and the rest run eagerly (said once, recorded); else
        :class:`CaptureFailed`, naming the operation, before the step changed anything."""
        reason = capture_failure(exc)
        if not self.fallback:
            raise CaptureFailed(f"CUDA graphs: the capture of the step's {part} graph failed at step {self.steps}: "
                                f"{reason}; the step did not run (a resume continues from the last checkpoint). "
                                f"Make the model's forward read no device value on the host, or leave out "
                                f"`cuda_graphs`") from exc
        self.failed = CaptureFailure(part, describe(key), self.steps, reason)
        self._entries.clear()
        self._events.append(f"CUDA graphs: the capture of the step's {part} graph failed at step {self.steps} "
                            f"({reason}); this step and the rest of the run run eagerly")
        self.eager_runs += 1
        body()
        return "eager"

    def _reason(self, part: str) -> str:
        if part in self._captured_parts:
            return "new batch shape"
        self._captured_parts.add(part)
        return self._reset_reason or "first capture"

    def warming_up(self) -> bool:
        """Whether a graph of the shapes seen still runs eagerly (a throughput measured now is not the graphs')."""
        entries = list(self._all_entries())
        return not entries or any(entry.graph is None for entry in entries)

    def reset(self, reason: str) -> None:
        """Drop every graph (what they read was reallocated or replaced); the next captures give ``reason``
        and go into a new memory pool (tensors of the old captures may still hold the old one)."""
        if any(entry.graph is not None for entry in self._all_entries()):
            self._reset_reason = reason
            self._captured_parts.clear()
            self.backend.new_pool()
        self._entries.clear()
        self._said_too_many = False

    def events(self) -> list[str]:
        """Lines worth logging since the last call."""
        events, self._events = self._events, []
        return events

    @property
    def pool_bytes(self) -> int:
        """Device memory the live graphs' pools hold."""
        return sum(entry.pool_bytes for entry in self._all_entries())

    def _all_entries(self) -> Iterator[_Entry]:
        return (entry for entries in self._entries.values() for entry in entries.values())

    def figures(self) -> dict[str, Any]:
        return {"backend": self.backend.name, "warmup_steps": self.warmup, "max_shapes": self.max_shapes,
                "fallback": self.fallback, "failed": asdict(self.failed) if self.failed is not None else None,
                "captures": [asdict(c) for c in self.captures],
                "recaptures": sum(1 for c in self.captures if c.reason != "first capture"),
                "capture_seconds": sum(c.seconds for c in self.captures), "pool_bytes": self.pool_bytes,
                "replays": self.replays, "eager_runs": self.eager_runs}


def describe(key: Hashable) -> str:
    """A step's inputs key (:meth:`StaticInputs.load`) as shapes: ``16x3x32x32``, or ``4 x 16x3x32x32`` for
    four learners' batches."""
    if not isinstance(key, tuple):
        return str(key)
    shapes = ["x".join(str(n) for n in batch[0]) for batch in key]
    if len(set(shapes)) == 1:
        return shapes[0] if len(shapes) == 1 else f"{len(shapes)} x {shapes[0]}"
    return ", ".join(shapes)
