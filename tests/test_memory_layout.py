"""The model's memory layout: asked for, fixed by the device, or measured at start-up on a CPU."""

import torch

from dimd.train.layout import choose_memory_format, layout_name, measured_memory_format
from dimd.train.models import build_model

CPU = torch.device("cpu")


def test_on_a_cpu_the_faster_layout_is_measured_on_a_copy_of_the_model(world):
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    layout, figures = measured_memory_format(model, 10, 32, batch=16, comm=world)
    assert layout in (torch.channels_last, torch.contiguous_format)
    faster = "channels_last" if figures["channels_last_s"] < figures["contiguous_s"] else "contiguous"
    assert layout_name(layout) == faster and figures["images"] == 8
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())   # the model is untouched
    assert all(p.is_contiguous() for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)     # and the run's random stream too


def test_a_request_sma_and_models_without_convolutions_are_not_measured(world):
    conv, linear = build_model("lenet", 10), torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    assert choose_memory_format(True, "ssgd", conv, CPU, 10, 32, 16, world) == (torch.channels_last,
                                                                                  {"how": "requested"})
    assert choose_memory_format(False, "ssgd", conv, CPU, 10, 32, 16, world)[0] == torch.contiguous_format
    assert choose_memory_format(None, "sma", conv, CPU, 10, 32, 16, world)[0] == torch.contiguous_format
    assert choose_memory_format(None, "ssgd", linear, CPU, 10, 32, 16, world) == (torch.contiguous_format,
                                                                                    {"how": "no convolutions"})
    assert "contiguous_s" in choose_memory_format(None, "ssgd", conv, CPU, 10, 32, 16, world)[1]
