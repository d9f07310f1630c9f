"""Which physical GPU each rank of a node computes on.

Clusters hand GPUs out in two ways. A launcher that binds one GPU to each
task (``srun --gpus-per-task=1``, ``--gpu-bind=single:1``, or anything that
sets ``CUDA_VISIBLE_DEVICES`` per rank) shows every rank one device, as
``cuda:0``; a plain launch shows every rank all of the node's GPUs. So CUDA's
index says nothing across ranks: two ranks at ``cuda:0`` may hold different
GPUs, and a GPU is known by its UUID (:func:`gpu_identity`). A rank takes the
first of its visible GPUs that no rank before it on the node took
(:func:`assign_gpus`): its own under a per-rank binding, the GPU at its
node-local rank where all are visible. A rank left without one is refused,
never doubled up on another's GPU.
"""

from __future__ import annotations

import socket
from typing import Any, Sequence


def gpu_identity(device: Any) -> str:
    """The physical GPU behind ``device`` (a CUDA index or torch.device of this process): its UUID (the same
    whatever ``CUDA_VISIBLE_DEVICES`` renumbers it to), or its PCI address where torch gives no UUID."""
    import torch

    properties = torch.cuda.get_device_properties(device)
    uuid = getattr(properties, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    return (f"PCI {getattr(properties, 'pci_domain_id', 0):04x}:{getattr(properties, 'pci_bus_id', 0):02x}:"
            f"{getattr(properties, 'pci_device_id', 0):02x}")


def visible_gpus() -> tuple[str, ...]:
    """The identities of the GPUs this process sees, in CUDA's order (``cuda:0`` first)."""
    import torch

    return tuple(gpu_identity(index) for index in range(torch.cuda.device_count()))


def assign_gpus(visible: Sequence[Sequence[str]]) -> list[int | None]:
    """For a node's ranks in order, each seeing the GPUs ``visible[r]``: the index (among its own visible GPUs)
    of the first one no rank before it took; None for a rank left without one."""
    taken: set[str] = set()
    picks: list[int | None] = []
    for gpus in visible:
        index = next((i for i, gpu in enumerate(gpus) if gpu not in taken), None)
        if index is not None:
            taken.add(gpus[index])
        picks.append(index)
    return picks


def too_few_gpus_problem(ranks: Sequence[int], visible: Sequence[Sequence[str]], picks: Sequence[int | None],
                         host: str) -> str | None:
    """Why some of a node's ``ranks`` are left without a GPU of their own, or None."""
    left = [rank for rank, pick in zip(ranks, picks) if pick is None]
    if not left:
        return None
    gpus = len({gpu for seen in visible for gpu in seen})
    return (f"{len(ranks)} ranks on {host} and {gpus} GPU(s) they can see: rank(s) {', '.join(map(str, left))} "
            f"would share a GPU; start at most one rank per GPU (SLURM: --gpus-per-task=1), or use `device` cpu")


def shared_gpu(ranks: Sequence[int], gpus: Sequence[str | None]) -> tuple[str, list[int]] | None:
    """The first GPU that two or more of a node's ``ranks`` compute on (None: a rank on the CPU), with those
    ranks; or None."""
    holders: dict[str, list[int]] = {}
    for rank, gpu in zip(ranks, gpus):
        if gpu is not None:
            holders.setdefault(gpu, []).append(rank)
    return next(((gpu, on) for gpu, on in holders.items() if len(on) > 1), None)


def node_gpu(comm: Any) -> tuple[int | None, str | None]:
    """Collective over ``comm``: the index of this rank's GPU among those it sees, and why some rank of its
    node has none (None when every rank has its own)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())   # MPI: this node's ranks
    try:
        visible = local.allgather(visible_gpus())
        ranks = local.allgather(comm.Get_rank())
        me = local.Get_rank()
    finally:
        local.Free()
    picks = assign_gpus(visible)
    return picks[me], too_few_gpus_problem(ranks, visible, picks, socket.gethostname())
