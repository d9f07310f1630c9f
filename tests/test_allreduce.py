"""dimd.allreduce on real ranks: every algorithm sums like numpy, for any P, size and dtype."""

import numpy as np
import pytest
from conftest import mpi_run
from mpi_case import case, say, world

from dimd.allreduce import ALGORITHMS, STANDALONE, AllreduceError, allreduce, color_trees
from dimd.allreduce.multicolor import internal_count


#: At P = 5 only the algorithms whose shape changes with P beyond 3: the butterflies run their two-round
#: exchange among 4 ranks after folding one in, and the trees grow a level; the others run as at P = 3.
FIVE_RANKS = ("tree", "multicolor", "recursive-doubling", "rabenseifner")


def sweep_sizes(ranks: int) -> list[int]:
    """Element counts around P and a few MiB, for :func:`allreduce_sweep` and its test."""
    return sorted({0, 1, 7, max(ranks - 1, 0), ranks + 1, 1000, (3 << 20) // 8 + 5})


@case
def allreduce_sweep(algorithms: str = "", colors: str = "") -> None:
    """Every standalone algorithm (or the comma-separated ALGORITHMS), on sizes around P and a few MiB, each dtype.

    ``colors`` sets the colour count of the algorithms that take one (multicolor's default is 4).

    Each result is checked against numpy's sum of every rank's input, and every
    rank must end with the same bits. Each rank prints a ``FAIL`` line per
    mismatch and then its count::

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py allreduce_sweep ring,tree
        -> rank 0 checked 56 failed 0
           rank 1 checked 56 failed 0 ...
    """
    import numpy as np

    from dimd.allreduce import ALGORITHMS, STANDALONE, allreduce

    comm = world()
    P, rank = comm.Get_size(), comm.Get_rank()
    names = algorithms.split(",") if algorithms else list(STANDALONE)
    checked = failed = 0
    for name in names:
        # small segments so that the pipelined algorithms run many segments
        options = {"segment_bytes": 40000} if "segment_bytes" in ALGORITHMS[name].options else {}
        if colors and "colors" in ALGORITHMS[name].options:
            options["colors"] = int(colors)
        for count in sweep_sizes(P):
            for dtype in ("float32", "float64", "int32", "int64"):
                rng = np.random.default_rng([rank, count, len(name)])
                if dtype.startswith("int"):
                    mine = rng.integers(-1000, 1000, count).astype(dtype)
                else:
                    mine = rng.standard_normal(count).astype(dtype)
                every = np.empty((P, count), dtype)
                comm.Allgather(mine, every)
                expected = every.sum(axis=0, dtype=np.float64 if dtype.startswith("f") else dtype)
                allreduce(mine, comm, name, **options)
                same = np.empty((P, count), dtype)
                comm.Allgather(mine, same)
                ok = (np.allclose(mine, expected, rtol=1e-5, atol=1e-4) if dtype.startswith("f")
                      else np.array_equal(mine, expected))
                ok = ok and bool((same == same[0]).all())
                checked += 1
                if not ok:
                    failed += 1
                    say(f"FAIL rank {rank} {name} count {count} {dtype}")
    say(f"rank {rank} checked {checked} failed {failed}")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_every_algorithm_sums_like_numpy(ranks):
    """Every algorithm, on sizes around P and a few MiB, each dtype, against numpy's
    sum of every rank's input; every rank must also end with the same bits. One rank,
    a power of two, and odd counts folded into the butterflies (P = 5 runs their
    two-round exchange among 4 ranks, as P = 4 would)."""
    names = FIVE_RANKS if ranks == 5 else tuple(STANDALONE)
    proc = mpi_run(allreduce_sweep, ranks, ",".join(names), timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "FAIL" not in proc.stdout, proc.stdout
    per_rank = len(names) * len(sweep_sizes(ranks)) * 4
    for rank in range(ranks):
        assert f"rank {rank} checked {per_rank} failed 0" in proc.stdout


@pytest.mark.mpi
def test_multicolor_with_two_level_trees_and_overlapping_colours():
    """3 colours on 5 ranks: every tree two levels deep, rank 0 a non-leaf in two colours, many segments."""
    trees = color_trees(5, 3)
    assert all(max(len(kids) for kids in t.children) == 3 and len(t.internal) == 2 for t in trees)
    assert trees[0].internal & trees[2].internal == {0}
    proc = mpi_run(allreduce_sweep, 5, "multicolor", "3", timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "FAIL" not in proc.stdout, proc.stdout
    assert proc.stdout.count("failed 0") == 5


@case
def allreduce_tensors_and_options() -> None:
    """A CPU tensor averaged in place, every colour count on a 2-D array, and one agreed fastest algorithm.

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py allreduce_tensors_and_options
        -> rank 0 ok ring   (one line per rank, the same algorithm on each)
    """
    import numpy as np
    import torch

    from dimd.allreduce import ALGORITHMS, allreduce, choose_fastest

    comm = world()
    P, rank = comm.Get_size(), comm.Get_rank()
    # a CPU tensor, summed in place and averaged (what data-parallel training does)
    grads = torch.full((3, 5), float(rank + 1))
    out = allreduce(grads, comm, "multicolor", colors=2, average=True)
    assert out is grads
    assert torch.allclose(grads, torch.full((3, 5), (P + 1) / 2)), grads
    # a 2-D array and every colour count, including more colours than ranks
    for colors in (1, 2, 3, 7):
        grid = np.full((4, 33), rank, dtype=np.float64)
        allreduce(grid, comm, "multicolor", colors=colors, segment_bytes=8)
        assert (grid == P * (P - 1) / 2).all(), (colors, grid)
    best = choose_fastest(1 << 16, comm, np.float32, ["mpi", "ring", "tree"], iters=3)
    everyone = comm.allgather(best)
    assert len(set(everyone)) == 1 and best in ALGORITHMS, everyone
    say(f"rank {rank} ok {best}")


@pytest.mark.mpi
def test_tensors_average_colours_and_choose_fastest():
    """A torch tensor averaged in place, every colour count, and one fastest algorithm that all ranks agree on."""
    proc = mpi_run(allreduce_tensors_and_options, 3, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" ok ") == 3


# One rank's error inside an allreduce ends the job: test_mpi_setup.py.

# Bad inputs are refused before any communication, so no communicator is needed.
@pytest.mark.parametrize("buf, algorithm, options, message", [
    (np.zeros(4), "no-such", {}, "unknown allreduce algorithm 'no-such'"),
    (np.zeros(4), "ring", {"colors": 2}, "does not take option(s) colors"),
    (np.zeros(4), "multicolor", {"colors": 0}, "colors of algorithm 'multicolor' must be a positive integer"),
    (np.zeros(4), "ring-root", {"segment_bytes": "1M"}, "must be a positive integer"),
    (np.zeros((4, 4))[:, 1], "ring", {}, "C-contiguous"),
    (np.zeros(4, dtype=np.float16), "ring", {}, "got float16"),
    (np.zeros(4, dtype=np.int32), "ring", {"average": True}, "average=True needs a floating-point"),
    ([1.0, 2.0], "ring", {}, "got list"),
])
def test_bad_inputs_are_clear_errors(buf, algorithm, options, message):
    with pytest.raises(AllreduceError) as info:
        allreduce(buf, None, algorithm, **options)
    assert message in str(info.value)


def test_read_only_buffer_is_refused():
    buf = np.zeros(8)
    buf.flags.writeable = False
    with pytest.raises(AllreduceError, match="writeable"):
        allreduce(buf, None, "mpi")


def test_registry_describes_every_algorithm():
    assert list(ALGORITHMS) == ["mpi", "ring", "ring-root", "multicolor", "tree", "ps",
                                "recursive-doubling", "rabenseifner", "torch", "nccl", "gloo"]
    # torch.distributed's: the caller's group, or the one dimd starts; sweeps over "every algorithm" leave them out
    assert {name: a.torch_group for name, a in ALGORITHMS.items() if a.torch_group} == {
        "torch": "caller", "nccl": "nccl", "gloo": "gloo"}
    assert STANDALONE == tuple(name for name in ALGORITHMS if name not in ("torch", "nccl", "gloo"))
    for name, algorithm in ALGORITHMS.items():
        assert algorithm.name == name and algorithm.description and "\n" not in algorithm.description


@pytest.mark.parametrize("size", range(1, 17))
@pytest.mark.parametrize("colors", [1, 2, 3, 4, 5])
def test_colour_trees_span_every_rank_with_disjoint_inner_nodes(size, colors):
    trees = color_trees(size, min(colors, size))
    for tree in trees:
        assert tree.parent[tree.root] == -1
        for rank in range(size):  # every rank reaches the root: a spanning tree
            seen, node = set(), rank
            while node != tree.root:
                assert node not in seen
                seen.add(node)
                node = tree.parent[node]
        assert sum(len(kids) for kids in tree.children) == size - 1
        assert max(len(kids) for kids in tree.children) <= len(trees)  # k-ary
    k = len(trees)
    if k * internal_count(size, k) <= size:  # P allows disjoint non-leaf sets
        inner = [tree.internal for tree in trees]
        assert sum(map(len, inner)) == len(frozenset().union(*inner))


def test_colour_trees_match_the_papers_figure():
    """DIMD Figure 2: 8 nodes, 4 colours; colour 0 rooted at 0 with 1 as its
    only other non-leaf, colour 1 rooted at 2 with 3."""
    trees = color_trees(8, 4)
    assert [t.root for t in trees] == [0, 2, 4, 6]
    assert trees[0].internal == {0, 1} and trees[1].internal == {2, 3}
