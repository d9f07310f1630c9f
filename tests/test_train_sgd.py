"""S-SGD's central property: one step on P ranks with batch b each equals one step on
one rank with batch P*b over the same images (model without batch norm), for several
allreduce algorithms; and every replica holds the same weights afterwards."""

from typing import Any, Callable

import pytest
from conftest import mpi_run
from mpi_case import case, say, world


@case
def sgd_step_equals_global_batch(*algorithms: str) -> None:
    """Three S-SGD steps on P ranks with batch b each, against one rank stepping on batch P*b.

    For each allreduce algorithm named, rank 0 prints how far the P-rank model is
    from the one-rank model (``diff``), how far the steps moved the weights
    (``moved``), and whether every replica holds the same weights::

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py sgd_step_equals_global_batch mpi ring tree
        -> mpi diff 2.98e-08 moved 0.0113 identical True
           ring diff ...
    """
    import torch

    from dimd.allreduce import allreduce
    from dimd.train.models import build_model
    from dimd.train.sgd import SSGD, broadcast_state, make_optimizer, replicas_identical
    from dimd.train.steps import StepPlace

    from dimd.host import available_cores

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(max(1, available_cores() // size))   # as dimd train does: ranks share the cores
    b = 6

    def engine(replicas: int, reduce: Callable[[Any], Any] | None) -> tuple[Any, SSGD]:
        torch.manual_seed(rank)           # different on purpose: the broadcast must fix it
        model = build_model("lenet", 10)
        broadcast_state(model, comm)
        opt = make_optimizer(model, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
        return model, SSGD(model, opt, reduce, replicas)

    g = torch.Generator().manual_seed(42)
    steps = [(torch.randn(size * b, 3, 32, 32, generator=g), torch.randint(0, 10, (size * b,), generator=g))
             for _ in range(3)]
    for algorithm in algorithms:
        model, sgd = engine(size, lambda a, algorithm=algorithm: allreduce(a, comm, algorithm))
        single, single_sgd = engine(1, lambda a: None)
        for images, labels in steps:
            mine = slice(rank * b, (rank + 1) * b)
            out = sgd.step([(images[mine], labels[mine])], StepPlace(lr=0.05))
            ref = single_sgd.step([(images, labels)], StepPlace(lr=0.05))
            assert out.samples == size * b and abs(out.loss_sum - ref.loss_sum) < 1e-3 * ref.loss_sum
        diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), single.parameters()))
        moved = max(float((p - q).detach().abs().max())
                    for p, q in zip(model.parameters(), engine(1, None)[0].parameters()))
        same = replicas_identical(model, comm)
        if rank == 0:
            say(f"{algorithm} diff {diff:.3g} moved {moved:.3g} identical {same}")


@pytest.mark.mpi
def test_p_ranks_equal_one_rank_with_the_global_batch():
    """Three steps with each of three allreduce algorithms, on 3 ranks (each algorithm's own sums are
    checked at several P in test_allreduce.py)."""
    proc = mpi_run(sgd_step_equals_global_batch, 3, "mpi", "ring", "tree", timeout=120, check=True)
    lines = proc.stdout.split("\n")
    for algorithm in ("mpi", "ring", "tree"):
        line = next(text for text in lines if text.startswith(algorithm + " "))
        _, _, diff, _, moved, _, same = line.split()
        assert float(diff) < 1e-5, line        # equal within float tolerance
        assert float(moved) > 1e-3, line       # and the steps really changed the weights
        assert same == "True", line
