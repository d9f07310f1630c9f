"""SMA's MPI test cases, run on real ranks under ``python -m mpi4py`` (the style of tests/mpi_cases.py).

    mpiexec -n 2 python -m mpi4py tests/sma_cases.py sma_distribution 2
    -> z diff 1.2e-08 buffers diff 3e-09 moved 0.03 identical True

``python -m mpi4py`` aborts the whole job when any rank raises, so a failed
``assert`` ends every rank at once.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

CASES: dict[str, Callable[..., None]] = {}


def case(function: Callable[..., None]) -> Callable[..., None]:
    CASES[function.__name__] = function
    return function


def world(thread_level: str = "single") -> Any:
    from dimd.mpi import init_mpi

    init_mpi(thread_level)
    from mpi4py import MPI

    return MPI.COMM_WORLD


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def small_bn_model(classes: int = 5) -> Any:
    """A convolution, batch norm and a linear layer: quick, and it has running statistics."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes))


@case
def sma_distribution(learners_per_rank: str, compute: str = "vmap", algorithm: str = "ring") -> None:
    """P ranks x K learners against one process with P*K learners fed the same batches.

    Rank 0 prints how far the distributed z (and, relatively, its averaged batch-norm
    statistics) is from the single-process one, how far three synchronisations moved z, and
    whether z is bit-identical on every rank::

        mpiexec -n 2 python -m mpi4py tests/sma_cases.py sma_distribution 2
        -> z diff 1.2e-08 buffers diff 3e-09 moved 0.03 identical True
    """
    import torch

    from dimd.allreduce import allreduce
    from dimd.train.sma import SMA

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    k = int(learners_per_rank)
    total, b = size * k, 3

    def sma(learners: int, world_size: int, reduce) -> SMA:
        torch.manual_seed(0)
        return SMA(small_bn_model(), reduce, world_size, learners=learners, alpha=None, momentum=0.9,
                   central_momentum=None, weight_decay=1e-3, compute=compute)

    g = torch.Generator().manual_seed(42)
    steps = [[(torch.randint(0, 255, (b, 3, 16, 16), dtype=torch.uint8, generator=g),
               torch.randint(0, 5, (b,), generator=g)) for _ in range(total)] for _ in range(3)]
    mine = sma(k, size, lambda a: allreduce(a, comm, algorithm))
    start = mine.z.clone()
    for batches in steps:
        result = mine.step(batches[rank * k:(rank + 1) * k], 0.05, sync=True)
        assert result.synced and result.samples == total * b, result
    mine.eval_model()
    identical = mine.identical(comm)
    if rank == 0:
        single = sma(total, 1, lambda a: None)
        for batches in steps:
            single.step(batches, 0.05, sync=True)
        single.eval_model()
        z_diff = float((mine.z - single.z).abs().max())
        buffers_diff = float(((mine.z_floats - single.z_floats).abs() / single.z_floats.abs().clamp(min=1)).max())
        moved = float((mine.z - start).abs().max())
        say(f"z diff {z_diff:.3g} buffers diff {buffers_diff:.3g} moved {moved:.3g} identical {identical}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--list"]:
        print("\n".join(CASES))
        return
    if not argv or argv[0] not in CASES:
        raise SystemExit(f"usage: python -m mpi4py {sys.argv[0]} CASE [ARG...]\ncases: {', '.join(CASES)}")
    CASES[argv[0]](*argv[1:])


if __name__ == "__main__":
    main()
