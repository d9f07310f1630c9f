"""S-SGD's central property: one step on P ranks with batch b each equals one step on
one rank with batch P*b over the same images (model without batch norm), for several
allreduce algorithms; and every replica holds the same weights afterwards."""

import pytest
from conftest import mpi_run


@pytest.mark.mpi
def test_p_ranks_equal_one_rank_with_the_global_batch():
    """Three steps with each of three allreduce algorithms, on 3 ranks (each algorithm's own sums are
    checked at several P in test_allreduce.py)."""
    proc = mpi_run("sgd_step_equals_global_batch", 3, "mpi", "ring", "tree", timeout=120, check=True)
    lines = proc.stdout.split("\n")
    for algorithm in ("mpi", "ring", "tree"):
        line = next(text for text in lines if text.startswith(algorithm + " "))
        _, _, diff, _, moved, _, same = line.split()
        assert float(diff) < 1e-5, line        # equal within float tolerance
        assert float(moved) > 1e-3, line       # and the steps really changed the weights
        assert same == "True", line
