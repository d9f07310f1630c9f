"""Mixed precision: autocast over the forward pass and loss, float32 weights and gradients, 16-mixed's loss scale."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpi_case import case, reduction, say, world

from dimd.errors import ConfigError
from dimd.train.config import TrainConfig
from dimd.train.flatgrad import FlatGradients
from dimd.train.precision import LossScale, Precision, memory_format

CPU = torch.device("cpu")


def small_conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def test_loss_scale_halves_on_overflow_and_doubles_after_a_run_of_finite_steps():
    scale = LossScale(scale=1024.0, growth_interval=3)
    scale.update(overflowed=True)
    assert (scale.scale, scale.skipped) == (512.0, 1)
    for _ in range(3):
        scale.update(overflowed=False)
    assert scale.scale == 1024.0 and scale.good_steps == 0
    restored = LossScale()
    restored.load_state_dict(scale.state_dict())
    assert restored == scale


def test_bf16_mixed_computes_in_bfloat16_and_keeps_weights_and_gradients_float32():
    model = small_conv()
    flat = FlatGradients(model.parameters())
    precision = Precision("bf16-mixed", CPU)
    with precision.autocast():
        logits = model(torch.randn(2, 3, 8, 8))
        loss = F.cross_entropy(logits, torch.tensor([0, 2]))
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    precision.backward(loss)
    assert flat.attached() and flat.grads.dtype == torch.float32 and bool(flat.grads.abs().sum() > 0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    flag = torch.zeros(())
    precision.unscale(flat.grads, flag)
    assert float(flag) == 0.0 and not precision.skip(0.0)
    assert precision.figures() == {"precision": "bf16-mixed"}


def test_16_mixed_scales_the_loss_and_undoes_it_before_the_allreduce():
    model, reference = small_conv(), small_conv()
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 2])
    F.cross_entropy(reference(x), y).backward()
    flat = FlatGradients(model.parameters())
    precision = Precision("16-mixed", CPU)
    with precision.autocast():
        loss = F.cross_entropy(model(x), y)
    precision.backward(loss)
    assert float(flat.grads.abs().max()) > 100    # scaled by 2**16
    flag = torch.ones(())
    precision.unscale(flat.grads, flag)
    assert float(flag) == 0.0
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert torch.allclose(flat.grads, expected, rtol=0.05, atol=1e-3)   # float16's forward, float32 gradients


def test_16_mixed_skips_a_step_when_any_rank_overflowed_and_counts_it():
    precision = Precision("16-mixed", CPU)
    grads, flag = torch.tensor([1.0, float("inf"), 3.0]), torch.zeros(())
    precision.unscale(grads, flag)
    assert float(flag) == 1.0                              # this rank's flag
    assert precision.skip(overflowed_ranks=1.0)            # the flags' sum over the ranks
    assert not precision.skip(overflowed_ranks=0.0)
    assert precision.figures() == {"precision": "16-mixed", "loss_scale": 2.0 ** 15, "skipped_steps": 1}
    fresh = Precision("16-mixed", CPU)
    assert fresh.load_state_dict(precision.state_dict()) == [] and fresh.loss_scale == precision.loss_scale
    notes = Precision("16-mixed", CPU).load_state_dict(Precision("32-true", CPU).state_dict())
    assert len(notes) == 1 and "starts afresh" in notes[0]


def test_channels_last_is_the_default_for_convolutional_models_on_cuda_only():
    conv, linear = small_conv(), nn.Linear(4, 2)
    assert memory_format(None, torch.device("cuda"), conv) == torch.channels_last
    assert memory_format(None, torch.device("cuda"), linear) == torch.contiguous_format
    assert memory_format(None, CPU, conv) == torch.contiguous_format
    assert memory_format(False, torch.device("cuda"), conv) == torch.contiguous_format
    assert memory_format(True, CPU, conv) == torch.channels_last


@pytest.mark.parametrize("fields, field", [
    ({"precision": "fp8"}, "precision"),
    ({"precision": "bf16-mixed", "sync": "sma"}, "precision"),
    ({"decode": "gpu", "device": "cpu"}, "decode"),
    ({"decode": "nvjpeg"}, "decode"),
])
def test_precision_and_decode_settings_are_checked_where_the_config_is_made(fields, field):
    with pytest.raises(ConfigError) as error:
        TrainConfig(train="t", val="v", **fields)
    assert error.value.field == field


def test_an_epoch_in_bf16_mixed_on_the_cpu_records_its_precision(packed_sample, tmp_path):
    from conftest import run_dimd

    out = tmp_path / "bf16"
    run_dimd("train", packed_sample, "--val", packed_sample, "--model", "lenet", "--image-size", "32",
             "--epochs", "1", "--batch-size", "8", "--lr", "0.01", "--no-lr-scaling", "--decode-workers", "1",
             "--threads", "1", "--precision", "bf16-mixed", "--device", "cpu", "--checkpoint-dir", out,
             "--json", tmp_path / "train.json", check=True, timeout=240)
    document = json.loads((tmp_path / "train.json").read_text())
    assert document["parameters"]["precision"] == "bf16-mixed"
    assert document["result"]["precision"] == "bf16-mixed" and document["result"]["epochs_run"] == 1
    assert math.isfinite(document["result"]["final"]["train_loss"])
    checkpoint = torch.load(sorted(out.glob("checkpoint-*.pt"))[-1], weights_only=True)
    assert checkpoint["config"]["precision"] == "bf16-mixed"
    assert all(v.dtype == torch.float32 for v in checkpoint["model"].values() if v.is_floating_point())


@case
def sixteen_mixed_skips_on_every_rank(*algorithms: str) -> None:
    """16-mixed S-SGD on P ranks: rank 1's gradients overflow in the second step (an inf in its batch).

    Every rank must skip that step, halve its loss scale and keep identical
    weights; rank 0 prints one JSON line per algorithm (default ring; gloo: the
    flag rides torch.distributed's allreduce of the buckets, the device path):
    per step, skipped / finite / scale, and whether the weights moved and the
    replicas agree.
    """
    for algorithm in algorithms or ("ring",):
        sixteen_mixed_steps(algorithm)


def sixteen_mixed_steps(algorithm: str) -> None:
    import torch

    from dimd.train.models import build_model
    from dimd.train.precision import Precision
    from dimd.train.sgd import SSGD, broadcast_state, make_optimizer, replicas_identical
    from dimd.train.steps import StepPlace

    comm = world()
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    broadcast_state(model, comm)
    precision = Precision("16-mixed", torch.device("cpu"))
    reduce, group = reduction(algorithm, comm)
    sgd = SSGD(model, make_optimizer(model, lr=0.05, momentum=0.9, weight_decay=0.0), reduce, comm.Get_size(),
               precision=precision, device_reduce=group, bucket_bytes=40_000)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for step in range(3):
        images = torch.randn(4, 3, 32, 32, generator=g)
        if step == 1 and rank == 1:
            images[0, 0, 0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        result = sgd.step([(images, torch.randint(0, 10, (4,), generator=g))], StepPlace(lr=0.05))
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        steps.append({"skipped": precision.last_skipped, "finite": result.finite, "moved": moved,
                      "scale": precision.loss_scale.scale, "events": len(result.events)})
    same = replicas_identical(model, comm)
    everyone = comm.gather(steps)
    sgd.close()
    if group is not None:
        group.close()
    if rank == 0:
        say(json.dumps({"algorithm": algorithm, "steps": steps, "ranks_agree": all(s == steps for s in everyone),
                        "identical": same}))


@pytest.mark.mpi
def test_16_mixed_skips_an_overflowing_step_on_every_rank_and_the_replicas_stay_identical():
    from conftest import mpi_run

    # ring: the flag rides dimd's host allreduce; gloo: torch.distributed's, the path NCCL takes on GPUs
    proc = mpi_run(sixteen_mixed_skips_on_every_rank, 2, "ring", "gloo", timeout=120, check=True)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [report["algorithm"] for report in reports] == ["ring", "gloo"]
    for report in reports:
        assert report["ranks_agree"] and report["identical"]
        first, overflowed, after = report["steps"]
        assert not first["skipped"] and first["moved"]
        assert overflowed == {"skipped": True, "finite": True, "moved": False, "scale": first["scale"] / 2,
                              "events": 1}
        assert not after["skipped"] and after["moved"]
