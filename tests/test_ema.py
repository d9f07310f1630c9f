"""--ema: the moving average is torch's AveragedModel with its EMA function, updated at a stride, saved and loaded."""

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from dimd.train.ema import WeightAverage


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def train_some(net: nn.Module, steps: int, average: WeightAverage | None = None,
               reference: AveragedModel | None = None, every: int = 1) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 4, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        if average is not None:
            average.after_step(step)
        if reference is not None and step % every == 0:
            reference.update_parameters(net)


@pytest.mark.parametrize("every", [1, 3])
def test_the_average_is_torchs_ema_of_weights_and_batch_norm_buffers_at_its_stride(every):
    net = model()
    average = WeightAverage(net, decay=0.9, every=every)
    reference = AveragedModel(copy.deepcopy(net), multi_avg_fn=get_ema_multi_avg_fn(0.9 ** every), use_buffers=True)
    reference.update_parameters(net)
    train_some(net, 10, average, reference, every)
    for (name, ours), theirs in zip(average.module.state_dict().items(), reference.module.state_dict().values()):
        assert torch.equal(ours, theirs), name
    assert not torch.equal(average.module[1].running_mean, torch.zeros(8))   # buffers are averaged too
    assert not torch.equal(average.module[0].weight, net[0].weight)          # an average, not the weights


def test_a_loaded_average_continues_exactly():
    net = model()
    average = WeightAverage(net, 0.8, every=1)
    train_some(net, 4, average)
    again = copy.deepcopy(net)
    resumed = WeightAverage(again, 0.8, every=1)
    resumed.load_state_dict(copy.deepcopy(average.state_dict()))   # as a checkpoint gives it back
    for weights, averaged in ((net, average), (again, resumed)):   # the same next step on both
        with torch.no_grad():
            weights[0].weight.add_(1.0)
        averaged.after_step(5)
    assert all(torch.equal(a, b) for a, b in zip(average.module.state_dict().values(),
                                                  resumed.module.state_dict().values()))


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_a_decay_outside_zero_one_is_refused(decay):
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\)"):
        WeightAverage(model(), decay)
