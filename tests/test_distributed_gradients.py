"""DistributedGradients and its buckets: the same averaged gradients as one flat allreduce, however cut.

The MPI cases here (``@case``, run on ranks by ``mpi_run``) compare against plain autograd plus one
MPI_Allreduce; the unit tests here run the bucket machinery on one process
with a stand-in for the sum over ranks.
"""

import contextlib
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import mpi_run
from mpi_case import case, say, world

from torch.utils.checkpoint import checkpoint

from dimd.errors import DimdError
from dimd.train.buckets import GradientBuckets
from dimd.train.models import build_model


def sum_of_three_identical_ranks(array: np.ndarray) -> None:
    """What an allreduce over three ranks holding the same gradients returns; +1 shows a second reduction."""
    array *= 3
    array += 1


def lenet_backward(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    F.cross_entropy(model(torch.randn(4, 3, 32, 32, generator=g)), torch.tensor([1, 2, 3, 4])).backward()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("bucket_bytes", [0, 1, 4096, 64 * 1024])
def test_every_gradient_is_reduced_once_and_averaged(overlap, bucket_bytes):
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    lenet_backward(model)
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    buckets = GradientBuckets(model.parameters(), sum_of_three_identical_ranks, 3, extras=2,
                              bucket_bytes=bucket_bytes, overlap=overlap)
    buckets.zero()
    lenet_backward(model)
    buckets.flat.extras.fill_(2.0)
    buckets.synchronize()
    for p, g in zip(model.parameters(), plain):
        assert torch.allclose(p.grad, (3 * g + 1) / 3, atol=1e-6)
    assert torch.equal(buckets.flat.extras, torch.full((2,), 7.0))   # summed, not averaged
    buckets.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_one_rank_keeps_its_gradients_without_an_allreduce(overlap):
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    lenet_backward(model)
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    calls = []
    buckets = GradientBuckets(model.parameters(), calls.append, 1, extras=2, bucket_bytes=4096, overlap=overlap)
    buckets.zero()
    lenet_backward(model)
    buckets.flat.extras.fill_(2.0)
    buckets.synchronize()
    assert calls == []   # on a GPU, no copy of the gradients to the host and back
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
    assert torch.equal(buckets.flat.extras, torch.full((2,), 2.0))
    buckets.close()


def test_zero_grad_set_to_none_is_copied_back_into_the_buffer():
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    buckets = GradientBuckets(model.parameters(), lambda a: None, 1, bucket_bytes=4096)
    for seed in range(2):
        model.zero_grad(set_to_none=True)
        lenet_backward(model, seed)
        buckets.synchronize()
        assert buckets.flat.attached()
    buckets.close()


def test_gradients_set_to_none_before_a_forward_are_written_into_the_buffer_again():
    """optimizer.zero_grad() sets every .grad to None; DistributedGradients' forward pre-hook points them back
    into the zeroed buffer, so backward adds in place: the same gradients, no new tensors to copy back."""
    torch.manual_seed(0)
    model, reference = build_model("lenet", 10), build_model("lenet", 10)
    reference.load_state_dict(model.state_dict())
    buckets = GradientBuckets(model.parameters(), lambda a: None, 1, bucket_bytes=4096)
    model.zero_grad(set_to_none=True)
    assert buckets.attach_if_released() and buckets.flat.attached()
    assert float(buckets.flat.buffer.abs().sum()) == 0.0
    assert not buckets.attach_if_released()            # already attached: nothing to do
    lenet_backward(model, 3)
    lenet_backward(reference, 3)
    assert buckets.flat.attached()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    buckets.close()


def test_a_second_backward_without_a_step_is_refused():
    model = build_model("lenet", 10)
    buckets = GradientBuckets(model.parameters(), lambda a: None, 2, bucket_bytes=4096)
    lenet_backward(model)
    with pytest.raises(RuntimeError, match="no_sync"):
        lenet_backward(model)
    buckets.close()


def test_an_error_on_the_communication_thread_reaches_synchronize():
    def broken(array: np.ndarray) -> None:
        raise ValueError("the network went away")

    model = build_model("lenet", 10)
    buckets = GradientBuckets(model.parameters(), broken, 2, bucket_bytes=4096)
    lenet_backward(model)
    with pytest.raises(ValueError, match="went away"):
        buckets.synchronize()
    buckets.close()


class BranchyNet:
    """Builds a model with odd parameter counts, a frozen layer and two branches a step may leave unused."""

    @staticmethod
    def build(seed: int = 0) -> Any:
        import torch
        from torch import nn

        class Branchy(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv2d(3, 5, 3)       # 135 + 5 parameters
                self.a = nn.Linear(180, 7)           # 1260 + 7
                self.b = nn.Linear(180, 7)
                self.frozen = nn.Linear(7, 7)
                self.frozen.requires_grad_(False)
                self.head = nn.Linear(7, 3)          # 21 + 3
                self.branch = "ab"                   # which branches forward uses

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.conv(x).relu().flatten(1)
                h = sum(getattr(self, name)(h) for name in self.branch)
                return self.head(self.frozen(h).relu())

        torch.manual_seed(seed)
        return Branchy()

    #: bucket sizes in bytes: one bucket, one per parameter, and cuts at every boundary in between
    BUCKET_BYTES = (0, 1, 16, 30, 100, 600, 5100, 6000, 10_000, 1 << 20)


def count_calls(owner: Any, name: str) -> list[None]:
    """Wrap ``owner.name`` so that each call appends to the returned list (then calls through)."""
    calls: list[None] = []
    wrapped = getattr(owner, name)

    def counted(*args: Any) -> Any:
        calls.append(None)
        return wrapped(*args)

    setattr(owner, name, counted)
    return calls


def local_gradients(model: Any, batches: list, branches: list[str]) -> Any:
    """This rank's summed gradients over ``batches`` by plain autograd, flat (zeros where none)."""
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    for (x, y), branch in zip(batches, branches):
        model.branch = branch
        F.cross_entropy(model(x), y).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters() if p.requires_grad])


@case
def distributed_gradients_match_flat_allreduce(*algorithms: str) -> None:
    """DistributedGradients against one flat MPI_Allreduce of plain autograd's gradients, averaged.

    For every bucket size of BranchyNet.BUCKET_BYTES, overlap on and off, and
    each algorithm: each rank leaves a different branch unused, a layer is
    frozen, and two of three backward passes run inside no_sync(). The
    gradients are compared as the last ``backward()`` returns, before any
    ``synchronize()``, which must then reduce nothing again. Rank 0 prints the
    largest difference per algorithm (0 at P = 2: sums of two are exact). ``gloo``
    reduces the buckets on the device path (torch.distributed's group, started
    once here and shared by every wrapper)::

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py distributed_gradients_match_flat_allreduce mpi ring gloo
        -> mpi configurations 20 max_diff 5.96e-08
    """
    import copy

    import numpy as np
    import torch
    from mpi4py import MPI

    from dimd.allreduce import BACKENDS, start_group
    from dimd.train.distributed import DistributedGradients

    comm = world("serialized")
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    groups = [start_group(comm, name) for name in BACKENDS if name in algorithms]   # one rendezvous, shared
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    branches = ["a", "b", "ab"] if rank % 2 == 0 else ["b", "b", "a"]   # rank 0 never uses b in pass 1...
    if rank == size - 1:
        branches = ["a", "a", "a"]          # ...and the last rank never uses b at all
    reference_model = BranchyNet.build()
    expected = local_gradients(reference_model, batches, branches).numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
    expected /= size
    for algorithm in algorithms:
        worst, configurations = 0.0, 0
        for bucket_bytes in BranchyNet.BUCKET_BYTES:
            for overlap in (True, False):
                model = copy.deepcopy(reference_model)
                grads = DistributedGradients(model, comm, algorithm=algorithm, overlap=overlap,
                                             bucket_mb=bucket_bytes / (1 << 20))
                # the buckets' reductions: over MPI, or started on the device's group (nccl, gloo)
                reductions = (count_calls(grads.buckets, "reduce") if grads.group is None else
                              count_calls(grads.group, "start"))
                model.zero_grad(set_to_none=True)
                for i, ((x, y), branch) in enumerate(zip(batches, branches)):
                    model.branch = branch
                    with grads.no_sync() if i < 2 else contextlib.nullcontext():
                        torch.nn.functional.cross_entropy(model(x), y).backward()
                assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
                got = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]).numpy()
                reduced = len(reductions)
                grads.synchronize()
                assert reduced == grads.buckets.buckets == len(reductions), (reduced, len(reductions))
                diff = float(np.abs(got - expected).max())
                assert diff <= (0.0 if size == 2 else 1e-6 * float(np.abs(expected).max())), (
                    algorithm, bucket_bytes, overlap, diff)
                worst, configurations = max(worst, diff), configurations + 1
                grads.close()
        if rank == 0:
            say(f"{algorithm} configurations {configurations} max_diff {worst:.3g}")
    for group in groups:
        group.close()


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_gradients_equal_one_flat_allreduce_for_every_bucket_size(ranks):
    proc = mpi_run(distributed_gradients_match_flat_allreduce, ranks, "mpi", "ring", "gloo", timeout=180,
                   check=True)
    for algorithm in ("mpi", "ring", "gloo"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(algorithm + " "))
        assert "configurations 20" in line
        if ranks == 2:
            assert line.endswith("max_diff 0")


@case
def overlap_on_and_off_train_alike(algorithm: str = "ring") -> None:
    """Nine SGD steps (momentum, weight decay, gradients clipped between backward and step, as in a DDP
    script) with overlap on and off.

    Each rank leaves a branch unused in some steps; one step accumulates two passes inside no_sync()
    and another finds one rank with no backward pass at all. A layer is frozen after wrapping. Two backward
    passes raise half-way on every rank, and the script skips those steps: after the first it goes on to a
    step that starts inside no_sync(); after the second it drops the pass with zero_grad() and makes an MPI
    call of its own. Rank 0 prints whether the two runs' weights are bit-identical and whether every rank
    holds the same weights::

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py overlap_on_and_off_train_alike ring
        -> identical True replicas True moved 0.0731
    """
    import torch
    import torch.nn.functional as F

    from dimd.train.distributed import DistributedGradients
    from dimd.train.sgd import replicas_identical

    comm = world("serialized")
    rank = comm.Get_rank()
    torch.set_num_threads(1)

    def train(overlap: bool) -> Any:
        model = BranchyNet.build(seed=rank)   # different on purpose: the broadcast must fix it
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9,
                                    weight_decay=0.01)
        grads = DistributedGradients(model, comm, algorithm=algorithm, overlap=overlap, bucket_mb=0.001,
                                     optimizer=optimizer)
        broken = []   # while it holds an item, the conv layer's gradient raises: the heads' buckets started first

        def backward_breaks(grad: torch.Tensor) -> None:
            if broken:
                raise ValueError("a broken backward pass")

        def hook_output(layer: Any, inputs: Any, out: torch.Tensor) -> None:
            out.register_hook(backward_breaks)

        model.conv.register_forward_hook(hook_output)
        g = torch.Generator().manual_seed(7 + rank)
        for step in range(9):
            model.branch = "ab" if (step + rank) % 3 else "a"
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            optimizer.zero_grad()
            if step == 2:
                model.a.bias.requires_grad_(False)   # frozen after wrapping: weight decay must not move it
                frozen = model.a.bias.clone()
            if step in (5, 7):
                broken.append(True)
                try:
                    F.cross_entropy(model(x), y).backward()
                except ValueError:
                    broken.clear()
                    if step == 7:
                        grads.zero_grad()   # drops the pass now: the script's own MPI call is safe after it
                        comm.allreduce(1)
                    continue
            if step == 3:     # every pass accumulates inside no_sync(); the step reduces the sum
                with grads.no_sync():
                    F.cross_entropy(model(x), y).backward()
                    F.cross_entropy(model(2 * x), y).backward()
            elif step == 6:   # after a raised pass: the first pass inside no_sync(), the second outside it
                with grads.no_sync():
                    F.cross_entropy(model(x), y).backward()
                F.cross_entropy(model(2 * x), y).backward()
            elif step != 4 or rank != 1:   # at step 4 rank 1 runs no backward pass: it takes part as zeros
                F.cross_entropy(model(x), y).backward()
            if step != 4:   # (rank 1's gradients are averaged only at the step there: nothing to clip before)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)   # reads and scales every .grad
            optimizer.step()
        grads.close()
        assert torch.equal(model.a.bias, frozen)
        return model

    on, off = train(True), train(False)
    identical = all(torch.equal(p, q) for p, q in zip(on.parameters(), off.parameters()))
    replicas = replicas_identical(on, comm)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(on.parameters(), BranchyNet.build().parameters()))
    if rank == 0:
        say(f"identical {identical} replicas {replicas} moved {moved:.3g}")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, algorithm", [(3, "ring"), (2, "gloo")])
def test_overlap_on_and_off_give_the_same_weights(ranks, algorithm):
    proc = mpi_run(overlap_on_and_off_train_alike, ranks, algorithm, timeout=180, check=True)
    assert "identical True replicas True" in proc.stdout
    assert float(proc.stdout.split("moved ")[1].split()[0]) > 0.01   # the steps did train


@case
def two_wrapped_models_in_one_backward(algorithm: str = "ring") -> None:
    """A GAN-like step: one backward pass through a generator and a discriminator, each wrapped with overlap.

    The discriminator has a branch rank 1 never uses (so the ranks complete its buckets in another order
    than the generator's) and batch norm with its statistics averaged (``sync_buffers``). The gradients as
    ``backward()`` returns are compared with plain autograd's, summed by one MPI_Allreduce::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py two_wrapped_models_in_one_backward ring
        -> steps 5 max_diff 0
    """
    import numpy as np
    import torch
    from mpi4py import MPI
    from torch import nn

    from dimd.train.distributed import DistributedGradients

    class Discriminator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 5), nn.Linear(3, 5)
            self.norm, self.out = nn.BatchNorm1d(5), nn.Linear(5, 1)
            self.use_b = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) + (self.b(x).tanh() if self.use_b else 0)
            return self.out(self.norm(h).relu())

    comm = world("serialized")
    torch.set_num_threads(1)
    generator, discriminator = BranchyNet.build(), Discriminator()
    discriminator.use_b = comm.Get_rank() != 1
    models = (generator, discriminator)
    grads = [DistributedGradients(generator, comm, algorithm=algorithm, bucket_mb=0.0005),
             DistributedGradients(discriminator, comm, algorithm=algorithm, bucket_mb=0.0001, sync_buffers=True)]
    g = torch.Generator().manual_seed(comm.Get_rank())
    worst, steps = 0.0, 5
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=g)
        for m in models:
            m.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as local:   # the same pass, by plain autograd on this rank alone
            for wrapped in grads:
                local.enter_context(wrapped.no_sync())
            discriminator(generator(x)).sum().backward()
        expected = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for m in models for p in m.parameters() if p.requires_grad]).numpy()
        comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
        expected /= comm.Get_size()
        for m in models:
            m.zero_grad(set_to_none=True)
        discriminator(generator(x)).sum().backward()
        got = torch.cat([p.grad.reshape(-1) for m in models for p in m.parameters() if p.requires_grad]).numpy()
        worst = max(worst, float(np.abs(got - expected).max()))
    for wrapped in grads:
        wrapped.close()
    if comm.Get_rank() == 0:
        say(f"steps {steps} max_diff {worst:.3g}")


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "mpi", "gloo"])
def test_two_wrapped_models_in_one_backward_average_both(algorithm):
    """Even where the ranks complete the two models' buckets in different orders (an unused branch)."""
    proc = mpi_run(two_wrapped_models_in_one_backward, 2, algorithm, timeout=180, check=True)
    assert "steps 5 max_diff 0" in proc.stdout


@case
def raised_pass_then_accumulation(algorithm: str = "ring") -> None:
    """Every rank's backward pass raises half-way (caught); the next step accumulates a pass inside
    no_sync() and one outside. Its gradients must be the two passes' average over ranks, as plain autograd
    plus one MPI_Allreduce gives them: the raised pass dropped, the accumulated one kept::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py raised_pass_then_accumulation ring
        -> overlap True max_diff 0 overlap False max_diff 0
    """
    import numpy as np
    import torch
    from mpi4py import MPI
    from torch import nn

    from dimd.train.distributed import DistributedGradients

    comm = world("serialized")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(comm.Get_rank())
    xs = [torch.randn(6, 5, generator=g) for _ in range(3)]
    line = []
    for overlap in (True, False):
        torch.manual_seed(0)
        head, tail = nn.Sequential(nn.Linear(5, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 3))
        model = nn.Sequential(head, tail)
        expected = torch.cat([p.reshape(-1) for p in torch.autograd.grad(
            model(xs[1]).square().mean() + model(xs[2]).square().mean(), list(model.parameters()))]).numpy()
        comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
        expected /= comm.Get_size()
        grads = DistributedGradients(model, comm, algorithm=algorithm, overlap=overlap, bucket_mb=0.0001)

        def refuse(grad: torch.Tensor) -> None:
            raise ValueError("a refused batch")

        hidden = head(xs[0])
        hidden.register_hook(refuse)   # the tail's buckets start, the head's never come
        try:
            tail(hidden).square().mean().backward()
        except ValueError:
            pass
        model.zero_grad()
        with grads.no_sync():
            model(xs[1]).square().mean().backward()
        model(xs[2]).square().mean().backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        grads.close()
        line.append(f"overlap {overlap} max_diff {float(np.abs(got - expected).max()):.3g}")
    if comm.Get_rank() == 0:
        say(" ".join(line))


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "gloo"])
def test_a_raised_pass_is_dropped_and_the_next_accumulation_kept(algorithm):
    proc = mpi_run(raised_pass_then_accumulation, 2, algorithm, timeout=180, check=True)
    diffs = [float(word) for word in proc.stdout.split("max_diff ")[1:] for word in [word.split()[0]]]
    assert len(diffs) == 2 and max(diffs) < 1e-6, proc.stdout


@case
def torch_groups_started_from_mpi() -> None:
    """torch.distributed's group started by dimd from MPI (no MASTER_ADDR or MASTER_PORT), shared by its users,
    and every refusal in one line on every rank; then the ``torch`` algorithm on a group the script started::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py torch_groups_started_from_mpi
        -> gloo sums ok shared ok refusals ok torch sum ok gradients ok
    """
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI

    from dimd.allreduce import allreduce, start_group, started_group
    from dimd.errors import DimdError
    from dimd.train.distributed import DistributedGradients

    comm = world("serialized")
    rank, size = comm.Get_rank(), comm.Get_size()
    whole = sum(range(1, size + 1))
    group = start_group(comm, "gloo")
    assert group.address.startswith("tcp://") and dist.get_backend() == "gloo"
    for count in (1, 7, 100_003):
        mine = np.arange(count, dtype=np.float32) * (rank + 1)
        allreduce(mine, comm, "gloo")                         # the registry's name, on this group
        assert np.array_equal(mine, np.arange(count, dtype=np.float32) * whole), count
    tensor = torch.full((5,), float(rank + 1))
    group.start(tensor, average=True).wait()                  # the mean, in place
    assert torch.equal(tensor, torch.full((5,), whole / size))
    line = ["gloo sums ok"]
    again = start_group(comm, "gloo")                         # a second user shares it
    assert again is group
    again.close()
    assert dist.is_initialized() and started_group("gloo") is group
    group.close()                                             # the last user ends it
    assert not dist.is_initialized() and started_group("gloo") is None
    line.append("shared ok")

    def refused(call: Callable[[], Any], *words: str) -> None:
        try:
            call()
        except DimdError as exc:
            message = str(exc)
        else:
            raise AssertionError("not refused")
        assert "\n" not in message and all(word in message for word in words), message
        assert comm.allgather(message) == [message] * size    # agreed: the same line on every rank

    refused(lambda: start_group(comm, "nccl", torch.device("cpu")), "nccl reduces tensors on GPUs")
    dist.init_process_group("gloo", init_method=start_group_free_address(comm), rank=rank, world_size=size)
    refused(lambda: start_group(comm, "gloo"), "already initialised", "algorithm 'torch'")
    line.append("refusals ok")
    try:   # the script's own group: algorithm torch reduces on it
        for count in (1, 100_003):
            mine = np.arange(count, dtype=np.float32) * (rank + 1)
            allreduce(mine, comm, "torch")
            assert np.array_equal(mine, np.arange(count, dtype=np.float32) * whole), count
        line.append("torch sum ok")
        model = BranchyNet.build()
        x, y = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(rank)), torch.tensor([0, 1, 2, 0])
        expected = local_gradients(BranchyNet.build(), [(x, y)], ["ab"]).numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
        grads = DistributedGradients(model, comm, algorithm="torch", bucket_mb=0.002)
        F.cross_entropy(model(x), y).backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]).numpy()
        assert np.allclose(got, expected / size, rtol=1e-6, atol=1e-7)
        grads.close()
        line.append("gradients ok")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        say(" ".join(line))


def start_group_free_address(comm: Any) -> str:
    """A ``tcp://`` address on rank 0's host for a script's own ``init_process_group`` (its own rendezvous)."""
    from dimd.host import free_port

    return comm.bcast(f"tcp://127.0.0.1:{free_port('127.0.0.1')}" if comm.Get_rank() == 0 else None)


@pytest.mark.mpi
def test_torch_distributed_groups_start_from_mpi_and_refuse_in_one_line():
    proc = mpi_run(torch_groups_started_from_mpi, 2, timeout=180, check=True)
    assert "gloo sums ok shared ok refusals ok torch sum ok gradients ok" in proc.stdout


def test_two_wrapped_models_in_one_backward_never_reduce_at_once():
    """A GAN's generator step reaches the discriminator too: its buckets and the generator's share one thread."""
    busy, overlapping = threading.Lock(), []

    def slow_sum(array: np.ndarray) -> None:
        if not busy.acquire(blocking=False):
            overlapping.append(array.size)
            return
        time.sleep(0.002)
        busy.release()

    torch.manual_seed(0)
    generator, discriminator = build_model("lenet", 10), torch.nn.Linear(10, 1)
    buckets = [GradientBuckets(m.parameters(), slow_sum, 2, bucket_bytes=1024, at_backward_end=lambda: None)
               for m in (generator, discriminator)]
    for _ in range(3):
        discriminator(generator(torch.randn(4, 3, 32, 32))).sum().backward()
        for b in buckets:
            b.synchronize()
    assert overlapping == []
    for b in buckets:
        b.close()


def test_a_layer_frozen_after_wrapping_stays_where_it_is():
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    buckets = GradientBuckets(model.parameters(), sum_of_three_identical_ranks, 3, bucket_bytes=4096)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    before = frozen.clone()
    for _ in range(2):
        buckets.zero()
        lenet_backward(model)
        buckets.synchronize()
        optimizer.step()
    assert frozen.grad is None and torch.equal(frozen, before)
    buckets.close()


def test_reentrant_checkpointing_of_the_last_layers_is_refused_in_one_line():
    """Checkpointed last layers give the first gradients from a nested pass, which ends before the rest come."""
    torch.manual_seed(0)
    body, tail = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU()), torch.nn.Linear(16, 10)
    model = torch.nn.Sequential(body, tail)
    reductions = []
    buckets = GradientBuckets(model.parameters(), reductions.append, 2, bucket_bytes=256,
                              at_backward_end=lambda: buckets.synchronize())

    def backward(use_reentrant: bool) -> None:
        checkpoint(tail, body(torch.randn(4, 12)), use_reentrant=use_reentrant).sum().backward()

    with pytest.raises(DimdError, match="use_reentrant=False"):
        backward(use_reentrant=True)
    reductions.clear()
    backward(use_reentrant=False)
    assert len(reductions) == buckets.buckets > 1   # each bucket once
    buckets.close()


class StandInStreams:
    """``torch.cuda``'s streams and events as DistributedGradients uses them, on the CPU: each thread has its
    current stream (named by the test), and every record and wait is logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self._current = threading.local()

    @contextlib.contextmanager
    def stream(self, name: str):
        """``with torch.cuda.stream(s)``: ``name`` is this thread's current stream inside."""
        before, self._current.name = getattr(self._current, "name", None), name
        try:
            yield
        finally:
            self._current.name = before

    def current_stream(self, device: Any = None) -> "StandInStream":
        return StandInStream(self, getattr(self._current, "name", None) or "the default stream")

    def Event(self) -> "StandInEvent":
        return StandInEvent(self)


class StandInStream:
    def __init__(self, streams: StandInStreams, name: str) -> None:
        self.streams, self.name = streams, name

    def wait_event(self, event: "StandInEvent") -> None:
        self.streams.log.append(("waits", self.name, f"for the event on {event.stream}"))


class StandInEvent:
    def __init__(self, streams: StandInStreams) -> None:
        self.streams, self.stream = streams, None

    def record(self, stream: StandInStream) -> None:
        self.stream = stream.name
        self.streams.log.append(("recorded", stream.name))


def test_the_stream_current_at_the_step_waits_for_the_reduction(monkeypatch):
    """On a GPU the reduction ends on autograd's thread and stream, as backward does; a script that steps on a
    stream of its own (``with torch.cuda.stream(s)``) steps once that stream has waited for it."""
    from mpi4py import MPI

    from dimd.train import distributed

    streams = StandInStreams()
    monkeypatch.setattr(distributed, "device_streams", lambda device: streams)
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # overlap off: its communication thread needs MPI at THREAD_SERIALIZED, which this test process may not have
    grads = distributed.DistributedGradients(model, MPI.COMM_SELF, algorithm="mpi", optimizer=optimizer,
                                             overlap=False)
    reduce = grads.buckets.synchronize
    grads.buckets.synchronize = lambda: (reduce(), streams.log.append(("reduced", streams.current_stream().name)))

    def autograds_thread() -> None:
        with streams.stream("autograd's stream"):
            lenet_backward(model)   # synchronize() runs as backward ends, here

    thread = threading.Thread(target=autograds_thread)
    thread.start()
    thread.join()
    with streams.stream("the script's stream"):
        optimizer.step()
    assert streams.log == [("reduced", "autograd's stream"), ("recorded", "autograd's stream"),
                           ("waits", "autograd's stream", "for the event on autograd's stream"),
                           ("waits", "the script's stream", "for the event on autograd's stream")]
    grads.close()


def test_mpi_called_off_the_callers_thread_is_named():
    """What needs MPI at THREAD_SERIALIZED: the communication thread, and on a GPU autograd's thread, where
    backward ends and synchronize() runs (the host sum, or sync_buffers' average beside a device group)."""
    from dimd.train.distributed import mpi_off_the_main_thread

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert "communication thread" in mpi_off_the_main_thread(False, True, False, cpu)
    assert mpi_off_the_main_thread(False, False, True, cpu) is None   # all on the caller's thread
    assert "the gradients' allreduce calls MPI" in mpi_off_the_main_thread(False, False, False, gpu)
    assert mpi_off_the_main_thread(True, True, False, gpu) is None    # nccl: no MPI as backward ends
    assert "sync_buffers=True averages the buffers over MPI" in mpi_off_the_main_thread(True, True, True, gpu)
