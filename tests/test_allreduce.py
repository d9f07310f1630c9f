"""dimd.allreduce on real ranks: every algorithm sums like numpy, for any P, size and dtype."""

import sys
import textwrap

import numpy as np
import pytest
from conftest import run_mpi

from dimd.allreduce import ALGORITHMS, AllreduceError, allreduce, color_trees
from dimd.allreduce.multicolor import internal_count

# Every algorithm, on sizes around P and a few MiB, each dtype, against numpy's
# sum of every rank's input; every rank must also end with the same bits.
SWEEP = textwrap.dedent("""
    import sys
    import numpy as np
    from dimd.mpi import init_mpi
    init_mpi("single")
    from mpi4py import MPI
    from dimd.allreduce import ALGORITHMS, allreduce

    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    algorithms = sys.argv[1].split(",") if len(sys.argv) > 1 else list(ALGORITHMS)
    sizes = sorted({0, 1, 7, max(P - 1, 0), P + 1, 1000, (3 << 20) // 8 + 5})
    checked = failed = 0
    for name in algorithms:
        # small segments so that the pipelined algorithms run many segments
        options = {"segment_bytes": 40000} if "segment_bytes" in ALGORITHMS[name].options else {}
        for count in sizes:
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
                    sys.stdout.write(f"FAIL rank {rank} {name} count {count} {dtype}\\n")
    sys.stdout.write(f"rank {rank} checked {checked} failed {failed}\\n")
    sys.stdout.flush()
""")


@pytest.fixture(scope="module")
def sweep_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("allreduce") / "sweep.py"
    path.write_text(SWEEP)
    return path


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_every_algorithm_sums_like_numpy(sweep_script, ranks):
    proc = run_mpi(ranks, sys.executable, sweep_script, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "FAIL" not in proc.stdout, proc.stdout
    per_rank = len(ALGORITHMS) * len({0, 1, 7, max(ranks - 1, 0), ranks + 1, 1000, (3 << 20) // 8 + 5}) * 4
    for rank in range(ranks):
        assert f"rank {rank} checked {per_rank} failed 0" in proc.stdout


def test_many_segments_and_colours_on_eight_ranks(sweep_script):
    """Deeper trees (two levels), overlapping colours and many pipelined segments."""
    proc = run_mpi(8, sys.executable, sweep_script, "multicolor,ring-root,rabenseifner", timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "FAIL" not in proc.stdout, proc.stdout
    assert proc.stdout.count("failed 0") == 8


OPTIONS_AND_TENSORS = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    from dimd.mpi import init_mpi
    init_mpi("single")
    from mpi4py import MPI
    from dimd.allreduce import allreduce, choose_fastest, ALGORITHMS

    comm = MPI.COMM_WORLD
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
    sys.stdout.write(f"rank {rank} ok {best}\\n")
""")


def test_tensors_average_colours_and_choose_fastest(tmp_path):
    script = tmp_path / "options.py"
    script.write_text(OPTIONS_AND_TENSORS)
    proc = run_mpi(3, sys.executable, script, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" ok ") == 3


ONE_BAD_RANK = textwrap.dedent("""
    import click
    import numpy as np
    from dimd.commands.mpi_job import mpi_command
    from dimd.allreduce import allreduce

    @click.command()
    @mpi_command("single")
    def job(comm, mpi_setup):
        buf = np.ones(1000)
        if comm.rank == 2:
            buf.flags.writeable = False
        allreduce(buf, comm, "ring")  # ranks 0 and 1 wait in here for rank 2
        print("finished", flush=True)

    job()
""")


def test_error_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / "bad_rank.py"
    script.write_text(ONE_BAD_RANK)
    proc = run_mpi(3, sys.executable, script, timeout=60)
    assert proc.returncode != 0
    assert "dimd: error: rank 2: allreduce needs a writeable buffer" in proc.stderr
    assert "finished" not in proc.stdout


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
                                "recursive-doubling", "rabenseifner"]
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
