"""DistributedGradients and its buckets: the same averaged gradients as one flat allreduce, however cut.

The MPI cases (tests/mpi_cases.py) compare against plain autograd plus one
MPI_Allreduce; the unit tests here run the bucket machinery on one process
with a stand-in for the sum over ranks.
"""

import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import mpi_run

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


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_gradients_equal_one_flat_allreduce_for_every_bucket_size(ranks):
    proc = mpi_run("distributed_gradients_match_flat_allreduce", ranks, "mpi", "ring", timeout=180, check=True)
    for algorithm in ("mpi", "ring"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(algorithm + " "))
        assert "configurations 20" in line
        if ranks == 2:
            assert line.endswith("max_diff 0")


@pytest.mark.mpi
def test_overlap_on_and_off_give_the_same_weights():
    proc = mpi_run("overlap_on_and_off_train_alike", 3, "ring", timeout=180, check=True)
    assert "identical True replicas True" in proc.stdout
    assert float(proc.stdout.split("moved ")[1].split()[0]) > 0.01   # the steps did train


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
def test_two_wrapped_models_in_one_backward_average_both(algorithm):
    """Even where the ranks complete the two models' buckets in different orders (an unused branch)."""
    proc = mpi_run("two_wrapped_models_in_one_backward", 2, algorithm, timeout=180, check=True)
    assert "steps 5 max_diff 0" in proc.stdout


@pytest.mark.mpi
def test_a_raised_pass_is_dropped_and_the_next_accumulation_kept():
    proc = mpi_run("raised_pass_then_accumulation", 2, "ring", timeout=180, check=True)
    diffs = [float(word) for word in proc.stdout.split("max_diff ")[1:] for word in [word.split()[0]]]
    assert len(diffs) == 2 and max(diffs) < 1e-6, proc.stdout


@pytest.mark.mpi
def test_torch_algorithm_sums_over_a_gloo_group():
    proc = mpi_run("torch_algorithm_sums_with_gloo", 2, timeout=180, check=True)
    assert "torch sum ok gradients ok" in proc.stdout


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
