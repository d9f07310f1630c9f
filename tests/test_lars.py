"""dimd.LARS: each layer's step scaled by its trust ratio eta*|w| / (|g| + lambda*|w|), batch norm and
biases exempt, momentum as torch's SGD, a tensor rate as good as a number, and an exact resume."""

import io

import pytest
import torch
from torch import nn

import dimd
from dimd.errors import ConfigError
from dimd.train.lars import LARS


def small_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(count)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> None:
    for images, labels in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()


def with_gradients(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One batch's gradients put in ``.grad``; each parameter's (weights, gradient) before the step."""
    images, labels = batches(1)[0]
    nn.functional.cross_entropy(model(images), labels).backward()
    return {name: (p.detach().clone(), p.grad.clone()) for name, p in model.named_parameters()}


def test_a_step_scales_each_layers_rate_by_its_trust_ratio():
    model = small_net()
    before = with_gradients(model)
    lr, eta, decay = 0.5, 0.02, 1e-3
    LARS(model.parameters(), lr=lr, weight_decay=decay, trust=eta).step()
    for name in ("0.weight", "4.weight"):
        w, g = before[name]
        ratio = eta * w.norm() / (g.norm() + decay * w.norm())
        expected = w - lr * ratio * (g + decay * w)
        got = dict(model.named_parameters())[name].detach()
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-7), name
        assert not torch.allclose(got, w - lr * (g + decay * w), rtol=1e-3)   # plain SGD's step differs


def test_a_layer_of_zero_weights_takes_the_plain_rate():
    model = small_net()
    with torch.no_grad():
        model[0].weight.zero_()
    before = with_gradients(model)
    LARS(model.parameters(), lr=0.5, trust=0.02).step()
    w, g = before["0.weight"]
    assert torch.equal(model[0].weight.detach(), w - g * 0.5)


def test_batch_norm_and_biases_take_neither_the_ratio_nor_weight_decay():
    model = small_net()
    before = with_gradients(model)
    LARS(model.parameters(), lr=0.5, weight_decay=0.1, trust=0.02).step()
    exempt = [name for name, p in model.named_parameters() if p.ndim == 1]
    assert exempt == ["0.bias", "1.weight", "1.bias", "4.bias"]
    for name in exempt:
        w, g = before[name]
        assert torch.equal(dict(model.named_parameters())[name].detach(), w - g * 0.5), name


def test_decay_bn_and_bias_gives_them_the_ratio_too():
    model = small_net()
    before = with_gradients(model)
    LARS(model.parameters(), lr=0.5, weight_decay=0.1, trust=0.02, decay_bn_and_bias=True).step()
    w, g = before["4.bias"]
    ratio = 0.02 * w.norm() / (g.norm() + 0.1 * w.norm())
    assert torch.allclose(model[4].bias.detach(), w - 0.5 * ratio * (g + 0.1 * w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_works_as_in_torchs_sgd(nesterov):
    """On batch norm and biases LARS is torch's SGD: the same gradients give the same weights."""
    ours, theirs = small_net(), small_net()
    lars = LARS([p for p in ours.parameters() if p.ndim == 1], lr=0.1, momentum=0.9, nesterov=nesterov)
    sgd = torch.optim.SGD([p for p in theirs.parameters() if p.ndim == 1], lr=0.1, momentum=0.9, nesterov=nesterov)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        for p, q in zip(ours.parameters(), theirs.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        lars.step()
        sgd.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)


def test_momentum_accumulates_the_ratio_scaled_directions():
    model = small_net()
    w0, g0 = with_gradients(model)["4.weight"]
    lars = LARS(model.parameters(), lr=0.5, momentum=0.9, trust=0.02)
    lars.step()
    g1 = torch.randn(g0.shape, generator=torch.Generator().manual_seed(5))
    model[4].weight.grad = g1.clone()
    w1 = model[4].weight.detach().clone()
    lars.step()
    first = 0.02 * w0.norm() / g0.norm() * g0
    second = 0.02 * w1.norm() / g1.norm() * g1
    expected = w1 - 0.5 * (0.9 * first + second)
    assert torch.allclose(model[4].weight.detach(), expected, rtol=1e-6, atol=1e-7)


def test_a_tensor_rate_gives_the_same_bits_as_a_number():
    data = batches(4)
    by_number, by_tensor = small_net(), small_net()
    train(by_number, LARS(by_number.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-3, nesterov=True), data)
    rate = torch.tensor(0.3)   # what a CUDA graph reads: a 0-d tensor on the parameters' device
    train(by_tensor, LARS(by_tensor.parameters(), lr=rate, momentum=0.9, weight_decay=1e-3, nesterov=True), data)
    for p, q in zip(by_number.parameters(), by_tensor.parameters()):
        assert torch.equal(p, q)


def test_a_rate_tensor_written_in_place_between_steps_is_read_at_each_step():
    """What a CUDA graph's replays rely on: the schedule writes the one tensor, the optimizer reads it anew."""
    data, rates = batches(4), [0.4, 0.2, 0.1, 0.05]
    by_number, by_tensor = small_net(), small_net()
    numbers = LARS(by_number.parameters(), lr=rates[0], momentum=0.9, weight_decay=1e-3)
    rate = torch.zeros(())
    tensors = LARS(by_tensor.parameters(), lr=rate, momentum=0.9, weight_decay=1e-3)
    for lr, batch in zip(rates, data):
        for group in numbers.param_groups:
            group["lr"] = lr
        rate.fill_(lr)
        train(by_number, numbers, [batch])
        train(by_tensor, tensors, [batch])
    for p, q in zip(by_number.parameters(), by_tensor.parameters()):
        assert torch.equal(p, q)


def test_a_resume_from_the_state_dict_continues_exactly():
    data = batches(6)
    whole = small_net()
    train(whole, LARS(whole.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-3), data)

    first = small_net()
    optimizer = LARS(first.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-3)
    train(first, optimizer, data[:3])
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved)

    resumed = small_net(seed=1)   # other weights, fresh buffers: the checkpoint must restore all of it
    optimizer = LARS(resumed.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-3)
    resumed.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(resumed, optimizer, data[3:])
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("trust", [0.0, -0.001])
def test_a_trust_coefficient_not_above_zero_is_refused(trust):
    with pytest.raises(ConfigError, match=r"^trust must be positive") as refused:
        LARS(small_net().parameters(), lr=0.1, trust=trust)
    assert "\n" not in str(refused.value)


def test_dimd_exports_lars_for_ones_own_loop():
    assert dimd.LARS is LARS
    assert "LARS" in dimd.__all__


def test_the_registry_builds_either_optimizer_over_the_same_parameter_groups():
    from dimd.train.optimizers import OPTIMIZERS, build_optimizer, optimizer_name

    model = small_net()
    built = {name: build_optimizer(name, model, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True, trust=0.02)
             for name in OPTIMIZERS}
    assert type(built["sgd"]) is torch.optim.SGD and type(built["lars"]) is LARS
    assert {name: optimizer_name(optimizer) for name, optimizer in built.items()} == {"sgd": "sgd", "lars": "lars"}
    layouts = [[(len(g["params"]), g["weight_decay"]) for g in o.param_groups] for o in built.values()]
    assert layouts[0] == layouts[1] == [(2, 1e-4), (4, 0.0)]   # weights decay; batch norm and biases do not
    assert built["lars"].param_groups[0]["trust"] == 0.02 and built["lars"].param_groups[0]["nesterov"]
    with pytest.raises(ConfigError, match=r"^optimizer must be one of sgd, lars \(got 'adam'\)$"):
        build_optimizer("adam", model, lr=0.1, momentum=0.9, weight_decay=0.0)
