"""``allreduce(buf, comm, algorithm, **options)``: checks, then the registered algorithm.

Every algorithm sums a 1-D contiguous numpy view in place. This module turns
what the caller has (an n-d array, a CPU torch tensor) into that view,
rejects what would silently go wrong (a copy, a read-only buffer, an unknown
option), and routes point-to-point algorithms onto a private duplicate of
``comm``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from dimd.allreduce.base import CALLER, AllreduceError
from dimd.allreduce.baseline import mpi_allreduce
from dimd.allreduce.buffers import private_comm
from dimd.allreduce.doubling import rabenseifner, recursive_doubling
from dimd.allreduce.group import TorchGroup, group_allreduce, start_group
from dimd.allreduce.multicolor import multicolor
from dimd.allreduce.ring import ring, ring_root
from dimd.allreduce.torchdist import caller_group, torch_allreduce
from dimd.allreduce.tree import parameter_server, tree

#: dtypes every algorithm (and MPI_SUM) handles.
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))

DEFAULT_COLORS = 4
#: None: each pipelined algorithm sizes its segments from the message (see their modules).
DEFAULT_SEGMENT_BYTES = None


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: its function, a one-line description and the options it takes."""

    name: str
    function: Callable[..., None]
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)  # name -> default (None: automatic)
    point_to_point: bool = True  # runs on a private duplicate of the caller's comm
    #: Needs nothing but the communicator. False (``torch``, ``nccl``, ``gloo``): needs a torch.distributed
    #: group, so automatic choices and sweeps over "every algorithm" leave it out (see STANDALONE).
    standalone: bool = True
    #: Reduces through torch.distributed, in place on the tensors' device: on the group the caller started
    #: (``CALLER``), or on the one dimd starts from MPI with this backend (``nccl``, ``gloo``); None: over MPI.
    torch_group: str | None = None

    def resolve(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options this call uses: defaults overlaid with ``options``, each checked."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            takes = ", ".join(sorted(self.options)) or "no options"
            raise AllreduceError(f"algorithm {self.name!r} does not take option(s) "
                                 f"{', '.join(unknown)} (it takes {takes})")
        resolved = {**self.options, **options}
        for name, value in resolved.items():
            if value is None and self.options[name] is None:
                continue  # automatic
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise AllreduceError(f"option {name} of algorithm {self.name!r} must be a "
                                     f"positive integer, got {value!r}")
            resolved[name] = int(value)
        return resolved


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("mpi", mpi_allreduce, "the MPI library's own MPI_Allreduce (the baseline)",
                  point_to_point=False),
        Algorithm("ring", ring, "bandwidth-optimal ring: reduce-scatter then allgather, P-1 steps each"),
        Algorithm("ring-root", ring_root,
                  "DIMD's pipelined ring: segments reduced along the ring to rank 0, broadcast back",
                  {"segment_bytes": DEFAULT_SEGMENT_BYTES}),
        Algorithm("multicolor", multicolor,
                  "DIMD's k-color allreduce: k chunks over k k-ary trees with disjoint inner nodes, pipelined",
                  {"colors": DEFAULT_COLORS, "segment_bytes": DEFAULT_SEGMENT_BYTES}),
        Algorithm("tree", tree, "FireCaffe's reduction tree: binomial reduce to rank 0, binomial broadcast"),
        Algorithm("ps", parameter_server,
                  "central parameter server: rank 0 receives every buffer, sums, sends the sum back"),
        Algorithm("recursive-doubling", recursive_doubling,
                  "butterfly exchanging the whole buffer log2(P) times (extra ranks folded in)"),
        Algorithm("rabenseifner", rabenseifner,
                  "recursive-halving reduce-scatter + recursive-doubling allgather (extra ranks folded in)"),
        Algorithm("torch", torch_allreduce,
                  "torch.distributed.all_reduce on the process group the caller initialised (gloo, NCCL)",
                  point_to_point=False, standalone=False, torch_group=CALLER),
        Algorithm("nccl", group_allreduce("nccl"),
                  "NCCL on the GPUs, in place in device memory: torch.distributed's group, started by dimd from MPI",
                  point_to_point=False, standalone=False, torch_group="nccl"),
        Algorithm("gloo", group_allreduce("gloo"),
                  "gloo on the CPUs: the same torch.distributed path as nccl, started by dimd from MPI",
                  point_to_point=False, standalone=False, torch_group="gloo"),
    )
}

#: The algorithms that run on the communicator alone: what choose_fastest and "all" sweep over.
STANDALONE: tuple[str, ...] = tuple(name for name, a in ALGORITHMS.items() if a.standalone)


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise AllreduceError(f"unknown allreduce algorithm {name!r}; choose from "
                             f"{', '.join(ALGORITHMS)}") from None


def device_group(algorithm: str, comm: Any, device: Any, *, stall_timeout: float = 600.0) -> TorchGroup | None:
    """Collective: the group ``algorithm`` reduces on where the tensors are (started now for nccl and gloo;
    the caller's for torch), or None for the algorithms that sum host buffers over MPI."""
    backend = get_algorithm(algorithm).torch_group
    if backend is None:
        return None
    if backend == CALLER:
        return caller_group()
    return start_group(comm, backend, device, stall_timeout=stall_timeout)


def as_flat_array(buf: Any) -> np.ndarray:
    """The 1-D writeable numpy view of ``buf`` (an ndarray or a CPU torch tensor), never a copy."""
    if type(buf).__module__.startswith("torch"):
        if getattr(buf, "device", None) is not None and buf.device.type != "cpu":
            raise AllreduceError(f"allreduce needs a CPU tensor, got one on {buf.device}")
        if not buf.is_contiguous():
            raise AllreduceError("allreduce needs a contiguous tensor (call .contiguous() first)")
        try:
            buf = buf.detach().numpy()
        except TypeError as exc:  # e.g. bfloat16 has no numpy dtype
            raise AllreduceError(f"allreduce cannot use a tensor of dtype {buf.dtype}: {exc}") from None
    if not isinstance(buf, np.ndarray):
        raise AllreduceError(f"allreduce needs a numpy array or a CPU torch tensor, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise AllreduceError("allreduce needs a C-contiguous buffer (it sums in place; "
                             "np.ascontiguousarray would sum a copy)")
    if not buf.flags.writeable:
        raise AllreduceError("allreduce needs a writeable buffer (it sums in place), got a read-only one")
    if buf.dtype not in SUPPORTED_DTYPES:
        raise AllreduceError(f"allreduce supports {', '.join(map(str, SUPPORTED_DTYPES))}, got {buf.dtype}")
    return buf.reshape(-1)


def allreduce(buf: Any, comm: Any, algorithm: str = "mpi", *, average: bool = False,
              **options: Any) -> Any:
    """Sum ``buf`` across ``comm`` in place with ``algorithm``; return ``buf``.

    Every rank must call it with the same algorithm, options, dtype and
    length. ``average=True`` divides the sum by the number of ranks (floating
    dtypes only). Options: ``segment_bytes`` (``ring-root``, ``multicolor``;
    default: sized from the message) and ``colors`` (``multicolor``, default
    4, capped at the number of ranks).
    """
    chosen = get_algorithm(algorithm)
    resolved = chosen.resolve(options)
    flat = as_flat_array(buf)
    if average and flat.dtype.kind != "f":
        raise AllreduceError(f"average=True needs a floating-point buffer, got {flat.dtype}")
    if flat.size and comm.Get_size() > 1:
        chosen.function(flat, private_comm(comm) if chosen.point_to_point else comm, **resolved)
    if average and comm.Get_size() > 1:
        np.divide(flat, comm.Get_size(), out=flat)
    return buf
