"""Measure allreduce algorithms the way nccl-tests and the OSU benchmarks do.

Per (size, algorithm): every rank times ``iters`` back-to-back in-place
allreduces after ``warmup`` untimed ones (a barrier before the timed loop);
each rank's per-iteration average is gathered, and the row reports their
average, minimum and maximum. algbw = bytes / time; busbw = algbw x 2(P-1)/P
(nccl-tests' bus bandwidth: what each rank's link carries in a ring). Timed
buffers hold zeros, so repeated in-place sums neither grow nor overflow; the
check runs separately on values with a known sum.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Iterable, Sequence

import numpy as np

from dimd.allreduce.api import (ALGORITHMS, DEFAULT_COLORS, STANDALONE, SUPPORTED_DTYPES, AllreduceError,
                                allreduce, get_algorithm)
from dimd.checks import at_least, finite, one_of, require
from dimd.stall import STALL_TIMEOUT_S, watch_job

DTYPE_NAMES = tuple(d.name for d in SUPPORTED_DTYPES)
PEERS = ("gloo",)  # torch.distributed backends timed in the same job

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
    """Memory one rank needs for a sweep up to ``max_bytes``: the buffer, an algorithm's scratch
    (about as much again), and with ``check`` the known values and their sum in int64."""
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


def time_reducer(run: Reducer, buf: np.ndarray, comm: Any, iters: int, warmup: int) -> tuple[float, float, float]:
    """(avg, min, max) over ranks of each rank's mean seconds per call."""
    from mpi4py import MPI

    for _ in range(warmup):
        run(buf)
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(iters):
        run(buf)
    mine = np.array([(MPI.Wtime() - start) / max(iters, 1)])
    every = np.empty(comm.Get_size())
    comm.Allgather(mine, every)
    return float(every.mean()), float(every.min()), float(every.max())


def known_values(count: int, dtype: np.dtype, rank: int) -> np.ndarray:
    """This rank's check input: small integers, different per rank, exact in every dtype."""
    return ((np.arange(count, dtype=np.int64) % 251) + 3 * rank + 1).astype(dtype)


def expected_sum(count: int, dtype: np.dtype, size: int) -> np.ndarray:
    return (size * (np.arange(count, dtype=np.int64) % 251) + 3 * size * (size - 1) // 2 + size).astype(dtype)


def count_wrong(run: Reducer, count: int, dtype: np.dtype, comm: Any) -> int:
    """Elements, summed over ranks, where ``run`` misses the known sum."""
    buf = known_values(count, dtype, comm.Get_rank())
    run(buf)
    wrong = np.array([np.count_nonzero(buf != expected_sum(count, dtype, comm.Get_size()))], dtype=np.int64)
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
          ) -> list[Row]:
    """Time every reducer at every size (size-major, so drift hits all alike); return the rows.

    Each (size, reducer) is one wait for the other ranks, marked with ``waiting``.
    """
    dtype = np.dtype(dtype)
    size = comm.Get_size()
    rows: list[Row] = []
    for nbytes in sizes:
        count = nbytes // dtype.itemsize
        buf = np.zeros(count, dtype=dtype)
        n_iters = iters if iters is not None else auto_iters(count * dtype.itemsize)
        n_warmup = warmup if warmup is not None else auto_warmup(n_iters)
        baseline = None
        for name, run in reducers.items():
            with waiting(f"{name}'s allreduce of {count * dtype.itemsize} bytes"):
                wrong = count_wrong(run, count, dtype, comm) if check else None
                buf.fill(0)
                avg, low, high = time_reducer(run, buf, comm, n_iters, n_warmup)
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
    reducers = {name: reducer(name, comm, options) for name in config.algorithms}
    closers = []
    if config.peer == "gloo":
        from dimd.allreduce.gloo import gloo_reducer

        reducers["gloo"], close = gloo_reducer(comm)
        closers.append(close)
    try:
        with watch_job(comm, config.stall_timeout) as watchdog:   # MPI: a lost peer ends the job, not hangs it
            rows = sweep(comm, reducers, config.sizes(), np.dtype(config.dtype), iters=config.iters,
                         warmup=config.warmup, check=config.check, on_row=on_row, waiting=watchdog.waiting)
    finally:
        for close in closers:
            close()
    wrong = sum(row.wrong or 0 for row in rows) if config.check else None
    return BenchResult(world_size=comm.Get_size(), rows=rows, wrong_total=wrong)
