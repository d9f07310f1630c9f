"""Measure allreduce algorithms the way nccl-tests and the OSU benchmarks do.

Per (size, algorithm): every rank times ``iters`` back-to-back in-place
allreduces after ``warmup`` untimed ones (a barrier before the timed loop);
each rank's per-iteration average is gathered, and the row reports their
average, minimum and maximum. algbw = bytes / time; busbw = algbw x 2(P-1)/P
(nccl-tests' bus bandwidth: what each rank's link carries in a ring). Timed
buffers hold zeros, so repeated in-place sums neither grow nor overflow; the
check runs separately on values with a known sum.

On device buffers (``device="cuda"``, the DIMD paper's figure 5 with a
modern row) the buffers are torch tensors in the GPU's memory
(:class:`TensorBuffers`) and the rows are what a GPU rank pays
(:func:`tensor_reducers`): NCCL's allreduce in device memory, the copy to
pinned host memory and back alone (``d2h+h2d``), and every host algorithm
with those copies around it, as S-SGD's host path runs them. The clock stops
once the device has finished. The same code times CPU tensors with gloo
instead of NCCL (the tests do).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Iterable, Sequence

import numpy as np

from dimd.allreduce.api import ALGORITHMS, DEFAULT_COLORS, STANDALONE, SUPPORTED_DTYPES, allreduce, get_algorithm
from dimd.allreduce.base import AllreduceError
from dimd.checks import at_least, finite, one_of, require
from dimd.stall import STALL_TIMEOUT_S, watch_job

DTYPE_NAMES = tuple(d.name for d in SUPPORTED_DTYPES)
PEERS = ("gloo",)  # torch.distributed backends timed in the same job
#: Where the timed buffers live: host memory (numpy), or a GPU's (torch tensors; NCCL and the copies).
DEVICES = ("cpu", "cuda")
#: The row of the copies alone, on device buffers: to pinned host memory and back, no sum.
COPY_ROW = "d2h+h2d"

#: An allreduce under test: sums a 1-D array in place across the job.
Reducer = Callable[[np.ndarray], None]
#: Marks a wait for the other ranks, named (a :class:`dimd.stall.StallWatchdog`'s ``waiting``).
Waiting = Callable[[str], ContextManager[None]]

_AUTO_BUDGET_BYTES = 128 << 20  # default iterations move about this much per row


def auto_iters(nbytes: int, cap: int = 200, floor: int = 5) -> int:
    """Iterations for a size: ``cap`` for small messages, fewer as they grow (>= ``floor``)."""
    return int(max(floor, min(cap, _AUTO_BUDGET_BYTES // max(nbytes, 1))))


def auto_warmup(iters: int) -> int:
    return max(2, iters // 10)


def message_sizes(min_bytes: int, max_bytes: int, factor: int, itemsize: int = 1) -> list[int]:
    """``min_bytes``, ``min_bytes * factor``, ... up to ``max_bytes`` (nccl-tests' -b/-e/-f).

    Every size is a whole number of ``itemsize``-byte elements, so each row's
    label is the size asked for: a ``min_bytes`` that is not is refused, and
    after 0 the sizes go on from one element.
    """
    if min_bytes < 0 or max_bytes < min_bytes:
        raise AllreduceError(f"need 0 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    if factor < 2:
        raise AllreduceError(f"the size factor must be at least 2, got {factor}")
    if min_bytes % itemsize:
        raise AllreduceError(f"the smallest size, {min_bytes} bytes, is not a whole number of "
                             f"{itemsize}-byte elements")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = itemsize if size == 0 else size * factor
    return sizes


def sweep_bytes(max_bytes: int, itemsize: int, check: bool) -> int:
    """Host memory one rank needs for a sweep up to ``max_bytes``: the buffer (on device buffers, its host
    copy), an algorithm's scratch (about as much again), and with ``check`` the known values and their sum
    in int64."""
    return 2 * max_bytes + (3 * 8 * (max_bytes // itemsize) if check else 0)


def reducer(algorithm: str, comm: Any, options: dict[str, Any]) -> Reducer:
    """``algorithm`` bound to ``comm`` with the options it takes (others are ignored)."""
    known = {name for a in ALGORITHMS.values() for name in a.options}
    unknown = sorted(set(options) - known)
    if unknown:
        raise AllreduceError(f"no algorithm takes option(s) {', '.join(unknown)}; "
                             f"known options: {', '.join(sorted(known))}")
    taken = {k: v for k, v in options.items() if k in get_algorithm(algorithm).options}
    return lambda buf: allreduce(buf, comm, algorithm, **taken)


def time_reducer(run: Reducer, buf: Any, comm: Any, iters: int, warmup: int,
                 settle: Callable[[], None] = lambda: None) -> tuple[float, float, float]:
    """(avg, min, max) over ranks of each rank's mean seconds per call; ``settle`` waits for a device's
    queued work (before the barrier, and before the clock stops)."""
    from mpi4py import MPI

    for _ in range(warmup):
        run(buf)
    settle()
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(iters):
        run(buf)
    settle()
    mine = np.array([(MPI.Wtime() - start) / max(iters, 1)])
    every = np.empty(comm.Get_size())
    comm.Allgather(mine, every)
    return float(every.mean()), float(every.min()), float(every.max())


def known_values(count: int, dtype: np.dtype, rank: int) -> np.ndarray:
    """This rank's check input: small integers, different per rank, exact in every dtype."""
    return ((np.arange(count, dtype=np.int64) % 251) + 3 * rank + 1).astype(dtype)


def expected_sum(count: int, dtype: np.dtype, size: int) -> np.ndarray:
    return (size * (np.arange(count, dtype=np.int64) % 251) + 3 * size * (size - 1) // 2 + size).astype(dtype)


class HostBuffers:
    """Numpy arrays in host memory, what dimd's algorithms sum."""

    def zeros(self, count: int, dtype: np.dtype) -> Any:
        return np.zeros(count, dtype=dtype)

    def clear(self, buf: Any) -> None:
        buf.fill(0)

    def known(self, count: int, dtype: np.dtype, rank: int) -> Any:
        return known_values(count, dtype, rank)

    def to_host(self, buf: Any) -> np.ndarray:
        return buf

    def settle(self) -> None:
        return None


class TensorBuffers(HostBuffers):
    """Torch tensors on ``device`` (a GPU's memory; the CPU's in tests); :meth:`settle` waits for the GPU."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def zeros(self, count: int, dtype: np.dtype) -> Any:
        import torch

        return torch.from_numpy(np.zeros(count, dtype=dtype)).to(self.device)

    def clear(self, buf: Any) -> None:
        buf.zero_()

    def known(self, count: int, dtype: np.dtype, rank: int) -> Any:
        import torch

        return torch.from_numpy(known_values(count, dtype, rank)).to(self.device)

    def to_host(self, buf: Any) -> np.ndarray:
        return buf.cpu().numpy()

    def settle(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


def tensor_reducers(comm: Any, names: Sequence[str], options: dict[str, Any], group: Any,
                    device: Any) -> dict[str, Reducer]:
    """What a rank pays to sum a tensor on ``device``: ``group``'s collective where the tensor is (NCCL's on a
    GPU), the copy to host memory and back alone (:data:`COPY_ROW`), and each of ``names`` between those copies
    (pinned host memory on a GPU, as S-SGD's host path copies its buckets)."""
    import torch

    staging: dict[tuple[int, Any], Any] = {}

    def host_copy(tensor: Any) -> Any:
        key = (tensor.numel(), tensor.dtype)
        if key not in staging:
            staging.clear()   # one size at a time: the sweep goes size by size
            staging[key] = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=device.type == "cuda")
        host = staging[key]
        host.copy_(tensor)
        return host

    def with_copies(host_reduce: Reducer | None) -> Reducer:
        def run(tensor: Any) -> None:
            host = host_copy(tensor)            # device to host (waits for the device)
            if host_reduce is not None:
                host_reduce(host.numpy())       # MPI: the host algorithm's sum
            tensor.copy_(host)                  # and back
        return run

    reducers: dict[str, Reducer] = {group.backend: lambda tensor: group.start(tensor).wait(),   # MPI: in place
                                    COPY_ROW: with_copies(None)}
    reducers.update({name: with_copies(reducer(name, comm, options)) for name in names})
    return reducers


def count_wrong(run: Reducer, count: int, dtype: np.dtype, comm: Any, buffers: HostBuffers | None = None) -> int:
    """Elements, summed over ranks, where ``run`` misses the known sum (:data:`COPY_ROW` is not checked)."""
    buffers = buffers or HostBuffers()
    buf = buffers.known(count, dtype, comm.Get_rank())
    run(buf)
    wrong = np.array([np.count_nonzero(buffers.to_host(buf) != expected_sum(count, dtype, comm.Get_size()))],
                     dtype=np.int64)
    total = np.empty(1, dtype=np.int64)
    comm.Allreduce(wrong, total)
    return int(total[0])


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    bytes: int
    count: int
    dtype: str
    algorithm: str
    iters: int
    time_us: float      # average over ranks of the per-iteration mean
    min_us: float
    max_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int | None   # None when not checked
    vs_mpi: float | None  # time / the MPI library's time at this size, when measured


def bandwidths(nbytes: int, seconds: float, size: int) -> tuple[float, float]:
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * 2 * (size - 1) / size


def sweep(comm: Any, reducers: dict[str, Reducer], sizes: Iterable[int], dtype: np.dtype, *,
          iters: int | None = None, warmup: int | None = None, check: bool = False,
          on_row: Callable[[Row], None] | None = None, waiting: Waiting = lambda what: contextlib.nullcontext(),
          buffers: HostBuffers | None = None) -> list[Row]:
    """Time every reducer at every size (size-major, so drift hits all alike); return the rows.

    Each (size, reducer) is one wait for the other ranks, marked with ``waiting``.
    ``buffers``: where the buffers live (default: numpy arrays; :class:`TensorBuffers`: a device's tensors).
    """
    dtype = np.dtype(dtype)
    size = comm.Get_size()
    buffers = buffers or HostBuffers()
    rows: list[Row] = []
    for nbytes in sizes:
        count = nbytes // dtype.itemsize
        n_iters = iters if iters is not None else auto_iters(count * dtype.itemsize)
        n_warmup = warmup if warmup is not None else auto_warmup(n_iters)
        baseline = None
        buf = buffers.zeros(count, dtype)   # one per size, cleared for each algorithm
        for name, run in reducers.items():
            with waiting(f"{name}'s allreduce of {count * dtype.itemsize} bytes"):
                wrong = count_wrong(run, count, dtype, comm, buffers) if check and name != COPY_ROW else None
                buffers.clear(buf)
                avg, low, high = time_reducer(run, buf, comm, n_iters, n_warmup, buffers.settle)
            if name == "mpi":
                baseline = avg
            algbw, busbw = bandwidths(count * dtype.itemsize, avg, size)
            row = Row(count * dtype.itemsize, count, dtype.name, name, n_iters, avg * 1e6, low * 1e6,
                      high * 1e6, algbw, busbw, wrong, None)
            rows.append(row)
        if baseline:
            for i in range(len(rows) - len(reducers), len(rows)):
                rows[i] = _with_ratio(rows[i], baseline)
        if on_row:
            for row in rows[len(rows) - len(reducers):]:
                on_row(row)
    return rows


def _with_ratio(row: Row, baseline_s: float) -> Row:
    return replace(row, vs_mpi=row.time_us / (baseline_s * 1e6))


def choose_fastest(nbytes: int, comm: Any, dtype: Any = np.float32, candidates: Sequence[str] | None = None,
                   *, iters: int | None = None, **options: Any) -> str:
    """The algorithm that allreduces ``nbytes`` of ``dtype`` fastest on ``comm``, timed now.

    Collective: every rank must call it with the same arguments, and every
    rank gets the same answer (the slowest rank's time decides each
    candidate). ``options`` (``colors``, ``segment_bytes``) go to the
    candidates that take them.
    """
    names = list(candidates) if candidates is not None else list(STANDALONE)
    if not names:
        raise AllreduceError("choose_fastest needs at least one candidate algorithm")
    for name in names:
        get_algorithm(name)
    dtype = np.dtype(dtype)
    count = max(0, nbytes // dtype.itemsize)
    n_iters = iters if iters is not None else max(3, auto_iters(nbytes, cap=50))
    buf = np.zeros(count, dtype=dtype)
    slowest = []
    for name in names:
        _, _, high = time_reducer(reducer(name, comm, options), buf, comm, n_iters, 1)
        slowest.append(high)
    return names[int(np.argmin(slowest))]


@dataclass(frozen=True)
class BenchConfig:
    """What ``dimd bench-allreduce`` measures: the only defaults, checked on construction."""

    algorithms: tuple[str, ...] = STANDALONE
    min_bytes: int = 8
    max_bytes: int = 64 << 20
    factor: int = 2
    iters: int | None = None     # None: auto_iters(size)
    warmup: int | None = None    # None: auto_warmup(iters)
    dtype: str = "float32"
    colors: int = DEFAULT_COLORS
    segment_bytes: int | None = None  # None: sized from the message
    check: bool = False
    peer: str | None = None      # "gloo": also time torch.distributed all_reduce
    device: str = "cpu"          # "cuda": device buffers: nccl, the copies alone, each algorithm with its copies
    extra_sizes: tuple[int, ...] = ()  # message sizes to add to the sweep (e.g. a model's gradients)
    stall_timeout: float = STALL_TIMEOUT_S   # seconds a rank waits for the others in a row; 0: forever

    def __post_init__(self) -> None:
        for name in self.algorithms:
            get_algorithm(name)
        require(bool(self.algorithms) or self.peer is not None, "algorithms",
                "is empty and there is no peer: nothing to measure")
        one_of(self, "dtype", DTYPE_NAMES)
        at_least(self, "iters", 1, optional=True)
        at_least(self, "warmup", 0, optional=True)
        at_least(self, "colors", 1)
        at_least(self, "segment_bytes", 1, optional=True)
        one_of(self, "peer", PEERS, optional=True)
        one_of(self, "device", DEVICES)
        require(self.device == "cpu" or self.peer is None, "peer",
                "times gloo on host buffers; with `device` cuda the table's torch.distributed row is nccl's")
        at_least(self, "factor", 2)
        at_least(self, "min_bytes", 0)
        require(self.min_bytes <= self.max_bytes, "min_bytes",
                f"must not exceed the largest size (got {self.min_bytes} > {self.max_bytes})")
        itemsize = np.dtype(self.dtype).itemsize
        require(self.min_bytes % itemsize == 0, "min_bytes",
                f"must be a whole number of {self.dtype} elements, a multiple of {itemsize} bytes "
                f"(got {self.min_bytes}): a row is labelled with the bytes it reduces")
        require(all(size >= 0 for size in self.extra_sizes), "extra_sizes",
                f"must be sizes of at least 0 bytes (got {list(self.extra_sizes)})")
        uneven = [size for size in self.extra_sizes if size % itemsize]
        require(not uneven, "extra_sizes", f"must be whole numbers of {self.dtype} elements, multiples of {itemsize} "
                                           f"bytes (got {uneven[0] if uneven else 0}): a row is labelled with the "
                                           f"bytes it reduces")
        at_least(self, "stall_timeout", 0)
        finite(self, "stall_timeout")

    def sizes(self) -> list[int]:
        """The sweep's sizes (-b, x -f, ... up to -e) and the extra ones, in increasing order."""
        sweep = message_sizes(self.min_bytes, self.max_bytes, self.factor, np.dtype(self.dtype).itemsize)
        return sorted(set(sweep) | set(self.extra_sizes))


def memory_problem(config: BenchConfig, budget: int) -> str | None:
    """Why ``config``'s largest message does not fit ``budget`` bytes per rank, or None."""
    from dimd.units import format_bytes

    largest = max(config.sizes(), default=0)
    need = sweep_bytes(largest, np.dtype(config.dtype).itemsize, config.check)
    if need > budget:
        return (f"a largest message of {format_bytes(largest)} (`max_bytes`) needs about "
                f"{format_bytes(need)} per rank, but a rank has {format_bytes(budget)} of available "
                f"memory on this node")
    return None


def check_memory(config: BenchConfig, comm: Any) -> None:
    """Collective: the largest message fits every rank's share of its node's memory, or every rank raises."""
    from dimd.host import available_memory
    from dimd.mpi import agree_or_raise, node_local_ranks

    agree_or_raise(comm, memory_problem(config, available_memory() // node_local_ranks(comm)))


@dataclass(frozen=True)
class BenchResult:
    """What ``dimd bench-allreduce`` measured: every row, and the check's total when it ran."""

    world_size: int
    rows: list[Row]
    wrong_total: int | None       # None when not checked
    model: str | None = None      # the model whose gradient size joined the sweep (the CLI's --model)
    gradient_bytes: int | None = None


def run_bench(config: BenchConfig, comm: Any, on_row: Callable[[Row], None] | None = None,
              on_start: Callable[[], None] | None = None) -> BenchResult:
    """Run the sweep ``config`` describes on ``comm`` (collective); every rank gets the result.

    Refused on every rank, before anything is allocated, when the largest
    message does not fit the node's available memory per rank (:func:`check_memory`);
    ``on_start`` runs once it is accepted, before the first row (a table's header).
    A row that waits longer than ``config.stall_timeout`` for the other ranks
    ends the job with a line naming it (:mod:`dimd.stall`).
    """
    check_memory(config, comm)
    if on_start is not None:
        on_start()
    options = {"colors": config.colors, "segment_bytes": config.segment_bytes}
    buffers: HostBuffers = HostBuffers()
    group = None
    if config.device == "cuda":   # the command checked that every rank has CUDA
        import torch

        from dimd.allreduce.group import start_group

        device = torch.device("cuda", torch.cuda.current_device())
        group = start_group(comm, "nccl", device, stall_timeout=config.stall_timeout)   # MPI: from the job
        reducers = tensor_reducers(comm, config.algorithms, options, group, device)
        buffers = TensorBuffers(device)
    else:
        reducers = {name: reducer(name, comm, options) for name in config.algorithms}
        if config.peer == "gloo":
            from dimd.allreduce.group import start_group

            group = start_group(comm, "gloo", stall_timeout=config.stall_timeout)   # MPI: from the job
            reducers["gloo"] = group.reduce_array
    try:
        with watch_job(comm, config.stall_timeout) as watchdog:   # MPI: a lost peer ends the job, not hangs it
            rows = sweep(comm, reducers, config.sizes(), np.dtype(config.dtype), iters=config.iters,
                         warmup=config.warmup, check=config.check, on_row=on_row, waiting=watchdog.waiting,
                         buffers=buffers)
    finally:
        if group is not None:
            group.close()
    wrong = sum(row.wrong or 0 for row in rows) if config.check else None
    return BenchResult(world_size=comm.Get_size(), rows=rows, wrong_total=wrong)
