"""SMA on real ranks: distribution does not change the algorithm; `dimd train --sync sma` end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import run_mpi

CASES = Path(__file__).with_name("sma_cases.py")


def sma_case(ranks: int, *args: str, timeout: float = 120):
    return run_mpi(ranks, sys.executable, "-m", "mpi4py", CASES, *args, timeout=timeout, check=True)


@pytest.mark.parametrize("ranks, per_rank, compute", [(2, 2, "vmap"), (3, 1, "loop")])
def test_p_ranks_of_k_learners_equal_one_process_of_p_times_k(ranks, per_rank, compute):
    """2 ranks x 2 learners against 1 x 4, and 3 x 1 against 1 x 3, fed the same batches."""
    proc = sma_case(ranks, "sma_distribution", str(per_rank), compute)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("z diff"))
    _, _, z_diff, _, _, buffers_diff, _, moved, _, identical = line.split()
    assert float(z_diff) < 1e-6, line           # the same z within float tolerance
    assert float(buffers_diff) < 1e-5, line     # and the same averaged batch-norm statistics
    assert float(moved) > 1e-3, line            # after synchronisations that really moved it
    assert identical == "True", line            # bit-identical on every rank
