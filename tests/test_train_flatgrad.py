"""The flat gradient buffer: grads are views, backward writes in place, buckets cover it."""

import numpy as np
import pytest
import torch

from dimd.train.flatgrad import FlatGradients, bucket_bounds
from dimd.train.models import build_model


def test_backward_writes_into_the_buffer():
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    flat = FlatGradients(model.parameters(), extras=3)
    assert flat.numel == sum(p.numel() for p in model.parameters())
    for _ in range(2):  # a second step accumulates in place too
        flat.zero()
        torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([1, 2, 3, 4])).backward()
        assert flat.attached()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(flat.grads, expected) and flat.grads.abs().sum() > 0
    assert torch.equal(flat.extras, torch.zeros(3))


def test_allreduce_sums_buckets_and_averages_only_gradients():
    model = build_model("lenet", 10)
    flat = FlatGradients(model.parameters(), extras=2, bucket_bytes=64 * 1024)
    assert len(flat.bucket_bounds) > 1
    flat.buffer.fill_(1.0)
    seen = []

    def fake_sum_of_three_ranks(array: np.ndarray) -> None:
        seen.append(array.size)
        array *= 3

    flat.allreduce(fake_sum_of_three_ranks, world_size=3)
    assert sum(seen) == flat.buffer.numel()
    assert torch.allclose(flat.grads, torch.ones(flat.numel))
    assert torch.equal(flat.extras, torch.full((2,), 3.0))
    assert all(torch.all(p.grad == 1) for p in model.parameters())


def test_set_to_none_is_caught():
    model = build_model("lenet", 10)
    flat = FlatGradients(model.parameters())
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="left the flat buffer"):
        flat.allreduce(lambda a: None, 1)


def test_bucket_bounds_cut_at_parameter_ends():
    ends = np.cumsum([100, 100, 300, 50, 10])
    assert bucket_bounds(ends, 565, 0, 4) == [(0, 565)]
    bounds = bucket_bounds(ends, 565, 800, 4)  # 200 elements a bucket
    assert bounds[0] == (0, 200) and bounds[-1][1] == 565
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert {b for _, b in bounds[:-1]} <= set(ends.tolist())


def test_a_small_first_bucket_is_cut_like_ddps_and_keeps_its_tail():
    ends = [100, 150, 300, 500, 560]
    assert bucket_bounds(ends, 565, 4000, 4) == [(0, 565)]                    # fits one bucket
    assert bucket_bounds(ends, 565, 4000, 4, first_bytes=400) == [(0, 100), (100, 565)]   # 100 elements first
    assert bucket_bounds(ends, 565, 800, 4, first_bytes=200) == [(0, 100), (100, 300), (300, 500), (500, 565)]
    assert bucket_bounds(ends, 565, 4000, 4, first_bytes=4000) == [(0, 565)]  # no smaller than a bucket
