"""CUDA graphs on a GPU: graphed S-SGD and SMA against the eager steps, a last batch of another size, the
auto-tuner's re-captures, and what a capture costs.

The epochs of dimd train in each precision, graphed against eager, and the resume under graphs are in
tests/test_cuda.py. Skipped where there is no CUDA device (``-m cuda`` selects them on a GPU machine); the
bookkeeping they rest on is tested on the CPU through the stand-in (tests/test_graphs.py).

Tolerances: a graphed step runs the eager step's kernels, except the optimizer (S-SGD: torch.optim.SGD's fused
kernel where the eager step uses its foreach kernels, which round the momentum update differently), and cuDNN's
convolution gradients may sum in another order from run to run. Steps compared with the same optimizer kernel
and cuDNN's deterministic algorithms agree within :data:`STEP_TOLERANCE`; whole epochs of ``dimd train`` (the
foreach kernel, any algorithm) within test_cuda.EPOCH_TOLERANCE.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from conftest import run_dimd
from test_cuda import assert_runs_close

from dimd.train.steps import StepPlace

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

#: (rtol, atol) of weights after a few steps with the same kernels (deterministic cuDNN).
STEP_TOLERANCE = (1e-5, 1e-6)


@contextlib.contextmanager
def deterministic_cudnn():
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic = before


def resnet20():
    from dimd.train.models import build_model

    torch.manual_seed(0)
    return build_model("resnet20", 10).cuda().to(memory_format=torch.channels_last)


def gpu_batches(sizes, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, device="cuda", generator=generator),
             torch.randint(0, 10, (n,), device="cuda", generator=generator)) for n in sizes]


def ssgd_pair(precision: str):
    """(eager S-SGD with the fused kernel, graphed S-SGD) from the same weights."""
    from dimd.shuffle.normalize import Normalize
    from dimd.train.graphed_sgd import GraphedSSGD
    from dimd.train.precision import Precision
    from dimd.train.sgd import SSGD, make_optimizer, parameter_groups

    device = torch.device("cuda", torch.cuda.current_device())
    normalize = Normalize(device, torch.channels_last)
    eager_model, graph_model = resnet20(), resnet20()
    eager = SSGD(eager_model, torch.optim.SGD(parameter_groups(eager_model, 1e-4), lr=0.1, momentum=0.9, fused=True),
                 lambda array: None, 1, normalize=normalize, precision=Precision(precision, device))
    graph = GraphedSSGD(graph_model, make_optimizer(graph_model, lr=0.1, momentum=0.9, weight_decay=1e-4),
                        lambda array: None, 1, normalize=normalize, precision=Precision(precision, device))
    return eager, graph


def assert_weights_close(a: torch.nn.Module, b: torch.nn.Module, tolerance) -> None:
    rtol, atol = tolerance
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x.float(), y.float(), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_a_graphed_ssgd_step_on_the_gpu_matches_the_eager_step(precision):
    with deterministic_cudnn():
        eager, graph = ssgd_pair(precision)
        for step, batch in enumerate(gpu_batches([16] * 8)):
            lr = 0.01 * (step + 1)   # a rate that changes at every step, read by the one capture
            ours, theirs = graph.step([batch], StepPlace(lr=lr)), eager.step([batch], StepPlace(lr=lr))
            assert ours.finite and ours.samples == theirs.samples == 16
            assert ours.loss_sum == pytest.approx(theirs.loss_sum, rel=1e-4)
    assert_weights_close(graph.model, eager.model, STEP_TOLERANCE)
    records = graph.figures()["cuda_graphs"]
    capture, = records["captures"]
    assert (capture["graph"], capture["step"], capture["reason"]) == ("step", 4, "first capture")
    assert capture["seconds"] > 0 and capture["pool_bytes"] > 0 and records["replays"] == 5
    if precision == "16-mixed":
        assert graph.precision.loss_scale.scale == eager.precision.loss_scale.scale


def test_a_last_batch_of_another_size_gets_a_graph_of_its_own_on_the_gpu():
    with deterministic_cudnn():
        eager, graph = ssgd_pair("32-true")
        graph.graphs.warmup = 1
        for batch in gpu_batches([16, 16, 16, 10, 10, 16, 10, 16]):
            graph.step([batch], StepPlace(lr=0.1))
            eager.step([batch], StepPlace(lr=0.1))
    assert_weights_close(graph.model, eager.model, STEP_TOLERANCE)
    captures = graph.figures()["cuda_graphs"]["captures"]
    assert [(c["shape"], c["reason"]) for c in captures] == [("16x3x32x32", "first capture"),
                                                             ("10x3x32x32", "new batch shape")]


@pytest.mark.parametrize("compute", ["branches", "loop"])
def test_graphed_sma_learners_on_the_gpu_match_the_eager_learners(compute):
    from dimd.shuffle.normalize import Normalize
    from dimd.train.graphed_sma import GraphedSMA
    from dimd.train.sma import SMA

    device = torch.device("cuda", torch.cuda.current_device())
    options = dict(learners=4, alpha=None, momentum=0.9, central_momentum=None, weight_decay=1e-4,
                   normalize=Normalize(device))
    with deterministic_cudnn():
        eager = SMA(resnet20().to(memory_format=torch.contiguous_format), lambda array: None, 1, **options)
        graph = GraphedSMA(resnet20().to(memory_format=torch.contiguous_format), lambda array: None, 1,
                           compute=compute, **options)
        steps = gpu_batches([16] * 4 * 8)
        for step in range(8):
            for strategy in (eager, graph):
                result = strategy.step(steps[4 * step: 4 * step + 4], StepPlace(lr=0.05))
                assert result.finite and result.samples == 64
    for a, b in ((eager.z, graph.z), (eager.learner_group.W, graph.learner_group.W),
                 (eager.learner_group.B, graph.learner_group.B)):
        torch.testing.assert_close(b, a, rtol=STEP_TOLERANCE[0], atol=STEP_TOLERANCE[1])
    parts = [c["graph"] for c in graph.figures()["cuda_graphs"]["captures"]]
    assert parts == (["learners"] if compute == "branches" else [f"learner {j}" for j in range(4)]) + ["update", "sync"]


class HalfOfTwoRanks:
    """A device reduce as NCCL's group behaves on a GPU, for one GPU: each bucket becomes the mean of this
    rank's and a second rank's zeros (half of it), computed on ``stream`` after the work the caller's stream
    queued before the call; ``wait()`` makes the caller's stream wait for it, not the host. ``stream`` None:
    on the caller's stream (the reference)."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.stream = stream
        self.started = 0

    def start(self, tensor: torch.Tensor, average: bool = False) -> "HalfOfTwoRanks._Done":
        assert average   # the strategies average the gradients; their extras ride scaled by the ranks
        self.started += 1
        current = torch.cuda.current_stream()
        stream = self.stream or current
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            tensor.mul_(0.5)
        done = torch.cuda.Event()
        done.record(stream)
        return HalfOfTwoRanks._Done(done)

    class _Done:
        def __init__(self, event: torch.cuda.Event) -> None:
            self.event = event

        def wait(self) -> None:
            torch.cuda.current_stream().wait_event(self.event)


def no_host_sum(array) -> None:
    raise AssertionError("the device path summed a host buffer")


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_graphed_step_on_several_ranks_reduces_between_its_graphs_on_the_device(precision):
    """The graphed S-SGD step of a rank of two, its buckets reduced as NCCL reduces them (on a stream of its own,
    between the forward and the update graph), against the eager step reducing on the compute stream."""
    from dimd.shuffle.normalize import Normalize
    from dimd.train.graphed_sgd import GraphedSSGD
    from dimd.train.precision import Precision
    from dimd.train.sgd import SSGD, make_optimizer, parameter_groups

    device = torch.device("cuda", torch.cuda.current_device())
    normalize = Normalize(device, torch.channels_last)
    reference, side = HalfOfTwoRanks(), HalfOfTwoRanks(torch.cuda.Stream())
    with deterministic_cudnn():
        eager_model, graph_model = resnet20(), resnet20()
        eager = SSGD(eager_model, torch.optim.SGD(parameter_groups(eager_model, 1e-4), lr=0.1, momentum=0.9,
                                                  fused=True),
                     no_host_sum, 2, normalize=normalize, precision=Precision(precision, device),
                     device_reduce=reference)
        graph = GraphedSSGD(graph_model, make_optimizer(graph_model, lr=0.1, momentum=0.9, weight_decay=1e-4),
                            no_host_sum, 2, normalize=normalize, precision=Precision(precision, device),
                            device_reduce=side)
        for step, batch in enumerate(gpu_batches([16] * 8)):
            lr = 0.01 * (step + 1)
            ours, theirs = graph.step([batch], StepPlace(lr=lr)), eager.step([batch], StepPlace(lr=lr))
            assert ours.finite and ours.samples == theirs.samples == 16   # the other rank's extras are zeros
            assert ours.loss_sum == pytest.approx(theirs.loss_sum, rel=1e-4)
    assert_weights_close(graph.model, eager.model, STEP_TOLERANCE)
    assert side.started == reference.started == 8 * len(graph.buckets.bounds)
    assert [c["graph"] for c in graph.figures()["cuda_graphs"]["captures"]] == ["forward", "update"]


# -- dimd train ------------------------------------------------------------------------------------


def train(data, out, *extra: str) -> dict:
    run_dimd("train", data, "--val", data, "--model", "resnet20", "--image-size", "32", "--batch-size", "8",
             "--lr", "0.01", "--no-lr-scaling", "--decode-workers", "2", "--device", "cuda", "--seed", "3",
             "--checkpoint-dir", out / "checkpoints", "--json", out / "train.json", *extra,
             check=True, timeout=300)
    return json.loads((out / "train.json").read_text())["result"]


def test_sma_with_graphed_learners_trains_as_the_eager_learners(packed_sample, tmp_path):
    sma = ["--epochs", "1", "--sync", "sma", "--learners", "2"]
    graphed = train(packed_sample, tmp_path / "graphed", *sma, "--cuda-graphs", "--learner-compute", "branches")
    eager = train(packed_sample, tmp_path / "eager", *sma, "--no-cuda-graphs")
    assert [c["graph"] for c in graphed["cuda_graphs"]["captures"]] == ["learners", "update", "sync"]
    assert graphed["compute"] == "branches" and eager["compute"] == "loop"
    assert_runs_close(graphed, eager)


def test_the_auto_tuner_re_captures_the_learners_it_adds_and_says_so():
    """A window of no length: a decision at every synchronisation once the graphs are captured."""
    from dimd.shuffle.normalize import Normalize
    from dimd.train.graphed_sma import GraphedSMA

    device = torch.device("cuda", torch.cuda.current_device())
    sma = GraphedSMA(resnet20().to(memory_format=torch.contiguous_format), lambda array: None, 1, learners=None,
                     alpha=None, momentum=0.9, central_momentum=None, weight_decay=1e-4, normalize=Normalize(device),
                     autotune_window=0.0, autotune_threshold=0.0, max_learners=3)
    events = []
    batches = gpu_batches([16] * 3)
    for _ in range(30):
        result = sma.step(batches[:sma.learners], StepPlace(lr=0.05))
        assert result.finite
        events += result.events
    decisions = sma.tuner.decisions
    assert decisions and decisions[0].learners_after == 2 and any("adding a learner" in e for e in events)
    captures = sma.figures()["cuda_graphs"]["captures"]
    # learner 0, update, sync; then learners 0 and 1, update, sync again for the new learner count
    assert [c["reason"] for c in captures[:7]] == ["first capture"] * 3 + ["learners per rank 1 -> 2"] * 4
    assert [c["graph"] for c in captures[3:7]] == ["learner 0", "learner 1", "update", "sync"]
    assert captures[3]["shape"] == "2 x 16x3x32x32"
