"""S-SGD's central property: one step on P = 2 ranks with batch b each equals one step on
one rank with batch 2b over the same images (model without batch norm), for several allreduce
algorithms; and every replica holds the same weights afterwards."""

import sys
import textwrap

from conftest import run_mpi

STEP_JOB = textwrap.dedent("""
    import sys
    import torch
    from mpi4py import MPI
    from dimd.allreduce import allreduce
    from dimd.train.models import build_model
    from dimd.train.sgd import SyncSGD, broadcast_state, make_optimizer, replicas_identical

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    b = 6

    def engine(world, reduce):
        torch.manual_seed(rank)           # different on purpose: the broadcast must fix it
        model = build_model("lenet", 10)
        broadcast_state(model, comm)
        opt = make_optimizer(model, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
        return model, SyncSGD(model, opt, reduce, world)

    g = torch.Generator().manual_seed(42)
    steps = [(torch.randn(size * b, 3, 32, 32, generator=g), torch.randint(0, 10, (size * b,), generator=g))
             for _ in range(3)]
    for algorithm in sys.argv[1:]:
        model, sgd = engine(size, lambda a: allreduce(a, comm, algorithm))
        single, single_sgd = engine(1, lambda a: None)
        for images, labels in steps:
            mine = slice(rank * b, (rank + 1) * b)
            out = sgd.step(images[mine], labels[mine])
            ref = single_sgd.step(images, labels)
            assert out.samples == size * b and abs(out.loss_sum - ref.loss_sum) < 1e-3 * ref.loss_sum
        diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), single.parameters()))
        moved = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), engine(1, None)[0].parameters()))
        same = replicas_identical(model, comm)
        if rank == 0:
            print(f"{algorithm} diff {diff:.3g} moved {moved:.3g} identical {same}", flush=True)
""")


def test_two_ranks_equal_one_rank_with_the_global_batch(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(STEP_JOB)
    proc = run_mpi(2, sys.executable, script, "mpi", "ring", "tree", timeout=120, check=True)
    lines = proc.stdout.split("\n")
    for algorithm in ("mpi", "ring", "tree"):
        line = next(l for l in lines if l.startswith(algorithm + " "))
        _, _, diff, _, moved, _, same = line.split()
        assert float(diff) < 1e-5, line        # equal within float tolerance
        assert float(moved) > 1e-3, line       # and the steps really changed the weights
        assert same == "True", line
