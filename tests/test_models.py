"""The model zoo: every model runs forward and backward on a tiny input."""

import pytest
import torch

from dimd.errors import DimdError
from dimd.train.models import MODELS, build_model, gradient_bytes, model_problem, parameter_count


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_and_backward_on_a_tiny_input(name):
    torch.manual_seed(0)
    model = build_model(name, num_classes=5)
    size = 32 if MODELS[name].image_size <= 32 else 64
    images = torch.randn(2, 3, size, size)
    logits = model(images)
    assert logits.shape == (2, 5)
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 3])).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_parameter_counts_match_the_papers():
    assert parameter_count(build_model("resnet20", 10)) == pytest.approx(0.27e6, rel=0.02)
    assert parameter_count(build_model("resnet50", 1000)) == 25_557_032   # torchvision's count
    assert gradient_bytes(build_model("resnet20", 10)) == 4 * parameter_count(build_model("resnet20", 10))


@pytest.mark.parametrize("name", ["resnet20", "resnet18"])
def test_zero_init_residual_zeroes_each_blocks_last_bn(name):
    model = build_model(name, 10, zero_init_residual=True)
    block = model.layers[0] if name == "resnet20" else model.layer1[0]
    assert float(block.bn2.weight.detach().abs().sum()) == 0
    plain = build_model(name, 10)
    assert float((plain.layers[0] if name == "resnet20" else plain.layer1[0]).bn2.weight.detach().abs().sum()) > 0


def test_unknown_model_names_the_choices():
    with pytest.raises(DimdError, match="unknown model 'alexnet'.*resnet20"):
        build_model("alexnet", 10)


def test_a_model_is_named_before_the_data_loads_without_building_it(tmp_path):
    """dimd train's check before the load: an unknown name or a user's file that fails is one line, and a
    user's builder is imported, not called (the class count it must get is the data's, not known yet)."""
    network = tmp_path / "net.py"
    network.write_text("def build(num_classes):\n    raise AssertionError('called before the data loaded')\n")
    assert model_problem("resnet20") is None and model_problem(f"{network}:build") is None
    assert model_problem("alexnet").startswith("unknown model 'alexnet'")
    assert model_problem(f"{network}:make").endswith("has no callable 'make'; it defines build")
    assert model_problem(f"{tmp_path}/missing.py:build").endswith("missing.py: no such file")


@pytest.mark.parametrize("name", list(MODELS))
def test_each_model_takes_its_smallest_image_and_nothing_smaller(name):
    smallest = MODELS[name].smallest_image
    model = build_model(name, num_classes=3).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 3, smallest, smallest)).shape == (1, 3)
        if smallest > 8:
            with pytest.raises(RuntimeError):
                model(torch.zeros(1, 3, smallest - 1, smallest - 1))


def test_a_model_given_too_small_an_image_is_refused_before_any_work():
    from dimd.errors import ConfigError
    from dimd.train.config import TrainConfig

    with pytest.raises(ConfigError, match="image_size.*must be at least 39 for nin \\(got 32\\)"):
        TrainConfig(train="t", val="v", model="nin", image_size=32)
    assert TrainConfig(train="t", val="v", model="nin", image_size=39).image_size == 39
