"""The training recipe's pieces against their definitions: label smoothing is torch's loss."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dimd.train.learners import Learners
from dimd.train.sgd import SSGD, make_optimizer
from dimd.train.steps import StepPlace, forward_backward


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))


def batch(n: int = 6):
    generator = torch.Generator().manual_seed(2)
    return (torch.randint(0, 256, (n, 3, 4, 4), dtype=torch.uint8, generator=generator),
            torch.randint(0, 5, (n,), generator=generator))


def normalize(images: torch.Tensor) -> torch.Tensor:
    return images.float().div(255)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_label_smoothing_is_torchs_cross_entropy_with_label_smoothing(eps):
    model, (images, labels) = net(), batch()
    stats = forward_backward(model, images, labels, normalize, label_smoothing=eps)
    expected = F.cross_entropy(model(normalize(images)), labels, label_smoothing=eps)
    torch.testing.assert_close(stats[0], expected.detach() * labels.numel())
    reference = net()
    F.cross_entropy(reference(normalize(images)), labels, label_smoothing=eps).backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_s_sgd_and_the_learners_train_on_the_smoothed_loss():
    images, labels = batch()
    model = net()
    sgd = SSGD(model, make_optimizer(model, lr=0.1, momentum=0.0, weight_decay=0.0), lambda a: None, 1,
               normalize=normalize, label_smoothing=0.1)
    before = net()
    result = sgd.step([(images, labels)], StepPlace(lr=0.1))
    expected = F.cross_entropy(before(normalize(images)), labels, label_smoothing=0.1).detach()
    assert result.loss_sum == pytest.approx(float(expected) * labels.numel(), rel=1e-6)
    learners = Learners(net(), 1, normalize=normalize, label_smoothing=0.1)
    _, stats = learners.gradients([images], [labels])
    assert float(stats[0, 0]) == pytest.approx(float(expected) * labels.numel(), rel=1e-6)
