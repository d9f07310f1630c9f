"""``dimd train --model FILE.py:callable``: a user's network gets dimd's loop, checkpoints and overlap."""

import json
from typing import Any

import pytest
import torch
from conftest import invoke_dimd, mpi_run, run_dimd, run_mpi_dimd
from mpi_case import case, reduction, say, world

NETWORK = """
from torch import nn


def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(24, 9), nn.ReLU(), nn.Linear(9, num_classes))


def not_a_network(num_classes):
    return "a string"
"""

#: A builder that takes a real classification only (two classes or more), as a user's may, and notes each call.
TWO_CLASSES_OR_MORE = """
from torch import nn


def build(num_classes):
    assert num_classes > 1, f"a classifier needs two classes or more, got {num_classes}"
    with open(__file__ + ".calls", "a") as calls:
        calls.write(f"{num_classes}\\n")
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))
"""


def train_args(data, out, model, *extra):
    return ["train", data, "--val", data, "--model", model, "--image-size", "16", "--epochs", "2",
            "--batch-size", "4", "--lr", "0.05", "--no-lr-scaling", "--schedule", "constant",
            "--decode-workers", "1", "--threads", "1", "--allreduce", "ring", "--checkpoint-dir", out / "checkpoints",
            "--json", out / "train.json", *extra]


@pytest.mark.mpi
def test_a_network_from_a_file_trains_overlapped_and_its_checkpoint_names_it(colour_set, tmp_path):
    network = tmp_path / "my_network.py"
    network.write_text(NETWORK)
    spec = f"{network}:build"
    run_mpi_dimd(2, *train_args(colour_set, tmp_path, spec, "--overlap", "--bucket-mb", "0.0005"),
                 timeout=240, check=True)
    result = json.loads((tmp_path / "train.json").read_text())["result"]
    assert result["model"]["name"] == spec and result["model"]["source"]["path"] == str(network)
    assert result["allreduce_choice"]["overlap"] is True and result["replicas_identical"] is True
    assert result["history"][-1]["train_loss"] < result["history"][0]["train_loss"]
    newest = sorted((tmp_path / "checkpoints").glob("checkpoint-*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    assert state["model_name"] == spec and len(state["model_source"]["sha256"]) == 64

    (tmp_path / "again").mkdir()
    other = run_dimd(*train_args(colour_set, tmp_path / "again", "lenet", "--resume-from", newest), timeout=120)
    assert other.returncode == 1
    assert other.stderr.strip().endswith(f"checkpoint of model '{spec}', not 'lenet'"), other.stderr
    assert other.stderr.count("\n") == 1


def test_a_builder_is_called_once_with_the_data_classes_only(colour_set, tmp_path):
    """A builder may refuse any class count but the data's (here a single class): dimd imports it before the
    load, to name a missing file or callable early, but calls it only once the load has counted the classes."""
    network = tmp_path / "classifier.py"
    network.write_text(TWO_CLASSES_OR_MORE)
    proc = run_dimd(*train_args(colour_set, tmp_path, f"{network}:build", "--epochs", "1"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "classifier.py.calls").read_text() == "4\n"   # the colour set's 4 classes, once


def test_a_model_file_that_exits_while_it_loads_is_an_error_naming_the_file(colour_set, tmp_path):
    """A script given as a model (it calls sys.exit(0) at its end) must not end the run as if it trained."""
    script = tmp_path / "train_script.py"
    script.write_text("import sys\n\n\ndef build(num_classes):\n    pass\n\n\nsys.exit(0)\n")
    proc = invoke_dimd(*train_args(colour_set, tmp_path, f"{script}:build"))
    assert (proc.returncode, proc.stderr) == (
        1, f"dimd: error: --model {script}:build: {script} called sys.exit(0) while loading\n")
    assert not (tmp_path / "train.json").exists()


@pytest.mark.parametrize("model, message", [
    ("missing.py:build", "missing.py: no such file"),
    ("NETWORK:make", "has no callable 'make'; it defines build, not_a_network"),
    ("NETWORK:not_a_network", "returned str, not a torch.nn.Module"),
])
def test_a_bad_model_file_or_callable_is_one_line(colour_set, tmp_path, model, message):
    network = tmp_path / "my_network.py"
    network.write_text(NETWORK)
    model = model.replace("NETWORK", str(network)).replace("missing.py", str(tmp_path / "missing.py"))
    proc = invoke_dimd(*train_args(colour_set, tmp_path, model))
    assert proc.returncode == 1
    assert proc.stderr.count("dimd: error:") == 1 and message in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "train.json").exists()


@case
def sgd_overlap_on_and_off_alike(*algorithms: str) -> None:
    """dimd train's S-SGD step (SSGD) with its buckets reduced during backward and after it: four
    steps each, LeNet, small buckets, with each algorithm (default ring; gloo: the device path, torch.distributed's
    group); rank 0 says per algorithm whether the weights and the step figures are identical with and without
    overlap, and whether every algorithm's are identical to the first's (bit for bit at P = 2)::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py sgd_overlap_on_and_off_alike ring gloo
        -> ring buckets 3 identical True loss 27.8
           gloo buckets 3 identical True loss 27.8
           algorithms alike True
    """
    import torch

    from dimd.train.models import build_model
    from dimd.train.sgd import SSGD, broadcast_state, make_optimizer
    from dimd.train.steps import StepPlace

    comm = world("serialized")
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)

    def run(overlap: bool, algorithm: str) -> tuple[Any, list, int]:
        torch.manual_seed(0)
        model = build_model("lenet", 10)
        broadcast_state(model, comm)
        opt = make_optimizer(model, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
        reduce, group = reduction(algorithm, comm)
        sgd = SSGD(model, opt, reduce, size, bucket_bytes=40_000, overlap=overlap, device_reduce=group)
        g = torch.Generator().manual_seed(rank)
        figures = [sgd.step([(torch.randn(6, 3, 32, 32, generator=g), torch.randint(0, 10, (6,), generator=g))],
                            StepPlace(lr=0.05)) for _ in range(4)]
        sgd.buckets.close()
        if group is not None:
            group.close()
        return model, [(r.loss_sum, r.correct, r.samples) for r in figures], sgd.buckets.buckets

    def same(a: tuple, b: tuple) -> bool:
        return a[1] == b[1] and all(torch.equal(p, q) for p, q in zip(a[0].parameters(), b[0].parameters()))

    runs = []
    for algorithm in algorithms or ("ring",):
        on, off = run(True, algorithm), run(False, algorithm)
        runs.append(on)
        if rank == 0:
            say(f"{algorithm} buckets {on[2]} identical {same(on, off)} loss {on[1][-1][0]:.3g}")
    if rank == 0 and len(runs) > 1:
        say(f"algorithms alike {all(same(runs[0], other) for other in runs[1:])}")


@pytest.mark.mpi
def test_the_sgd_step_trains_alike_with_and_without_overlap_on_the_host_and_on_the_device_path():
    """ring sums host buffers over MPI; gloo reduces the buckets in place through torch.distributed (the path
    NCCL takes on GPUs): at P = 2 the weights are the same bits either way."""
    proc = mpi_run(sgd_overlap_on_and_off_alike, 2, "ring", "gloo", timeout=180, check=True)
    lines = proc.stdout.splitlines()
    for algorithm in ("ring", "gloo"):
        line = next(x for x in lines if x.startswith(algorithm + " "))
        assert "identical True" in line and "buckets 1 " not in line, line
    assert "algorithms alike True" in lines
