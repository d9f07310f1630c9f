"""Where a rank computes: its torch threads and its device, chosen the same way by training and the planner."""

from __future__ import annotations

import os
from typing import Any

import torch


def default_threads(comm: Any) -> int:
    """Collective: torch threads per rank by default, the rank's cores over the node's ranks bound to them."""
    from dimd.mpi import node_cores

    return node_cores(comm).threads   # MPI: gathered over the node's ranks


def default_decode_workers(comm: Any) -> int:
    """Collective: decoding worker processes per rank by default: the rank's share of the node's cores, but one
    (the training process's); at least one."""
    return max(1, default_threads(comm) - 1)


def set_threads(threads: int | None, comm: Any) -> tuple[int, str | None]:
    """Collective: torch threads as ``dimd train`` sets them, ``threads`` else :func:`default_threads`
    (left alone when OMP_NUM_THREADS is set and ``threads`` is not). Returns the count in force
    and, when the launcher's binding leaves some rank less than its share of the node (or ``threads``
    outnumber some rank's cores), why."""
    from dimd.mpi import node_cores

    cores = node_cores(comm)   # MPI: every rank takes part, whichever count it uses
    if threads or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads or cores.threads)
    warnings = comm.allgather(cores.too_many_threads(threads) if threads else cores.tight_binding())
    return torch.get_num_threads(), next((w for w in warnings if w), None)


def pick_device(choice: str, comm: Any) -> torch.device:
    """Collective unless ``cpu``. ``cuda``: a GPU of its own for each rank of a node, by node-local rank among
    the GPUs the rank sees (:func:`dimd.gpus.assign_gpus`: one each under a per-rank binding, the node's
    GPUs in turn where all are visible); every rank must find one, or every rank stops with one line (no
    CUDA; more ranks on a node than GPUs they see). ``auto``: the same where every rank has CUDA, else the
    CPU on every rank (a job whose nodes differ would otherwise leave its CPU ranks behind while the others
    pair up the node's GPUs)."""
    if choice == "cpu":
        return torch.device("cpu")
    from mpi4py import MPI

    from dimd.gpus import node_gpu
    from dimd.mpi import agree_or_raise

    if choice == "auto" and not comm.allreduce(int(torch.cuda.is_available()), op=MPI.MIN):   # MPI: on every rank?
        return torch.device("cpu")
    if choice == "cuda":
        agree_or_raise(comm, None if torch.cuda.is_available()   # MPI: every rank asked for cuda
                       else "device cuda: this torch build or machine has no CUDA device")
    index, problem = node_gpu(comm)   # MPI: this node's ranks and the GPUs each sees
    agree_or_raise(comm, problem)     # MPI: a node with more ranks than GPUs stops every rank
    assert index is not None
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
