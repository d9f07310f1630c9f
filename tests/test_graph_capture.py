"""What a CUDA graph's capture may and may not do, run on the CPU through the stand-in, which refuses what a
CUDA capture refuses: a model that reads a device value on the host falls back to eager steps (graphs on by
default) or stops with the operation named (asked for); nothing else touches the device while a graph is
captured; learners replayed side by side draw their own random numbers; a reset takes a new memory pool."""

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from dimd.errors import DimdError
from dimd.shuffle.device_feed import DeviceFeed
from dimd.train.config import TrainConfig
from dimd.train.engine import Hooks, Trainer
from dimd.train.graphed_sgd import GraphedSSGD
from dimd.train.graphed_sma import GraphedSMA
from dimd.train.graphs import CaptureFailed, StandIn
from dimd.train.sgd import make_optimizer
from dimd.train.sma import SMA
from dimd.train.steps import StepPlace

HOST_READ_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x):
        if x.abs().max().item() > 1e6:   # a host read: no CUDA graph can capture it
            x = x.clamp(-1e6, 1e6)
        return self.fc(self.conv(x).relu().mean((2, 3)))


def build(num_classes):
    return Net(num_classes)
'''


@pytest.fixture(scope="module")
def host_read_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "host_read.py"
    path.write_text(HOST_READ_MODEL)
    return f"{path}:build"


def config(packed_sample: Path, model: str, **options) -> TrainConfig:
    return TrainConfig(train=str(packed_sample), val=str(packed_sample), model=model, image_size=16, epochs=2,
                       batch_size=8, lr=0.05, lr_scaling=False, schedule="cosine", decode_workers=1, threads=1,
                       **options)


def test_a_capture_that_fails_with_graphs_on_by_default_runs_the_rest_eagerly(packed_sample, world, host_read_model):
    events: list[str] = []
    graphed = Trainer(config(packed_sample, host_read_model), world, graph_backend=StandIn(),
                      hooks=Hooks(on_event=events.append))
    figures = graphed.run().figures()
    eager = Trainer(config(packed_sample, host_read_model), world)
    eager.run()
    graphs = figures["cuda_graphs"]
    failed = graphs["failed"]
    assert graphs["fallback"] and graphs["captures"] == [] and failed["graph"] == "step" and failed["step"] == 4
    assert "operation not permitted when stream is capturing" in failed["reason"]
    assert "host_read.py:13 (if x.abs().max().item() > 1e6:" in failed["reason"]
    said = [event for event in events if event.startswith("CUDA graphs:")]
    assert len(said) == 1 and "this step and the rest of the run run eagerly" in said[0]
    assert graphs["eager_runs"] == 2 * figures["steps_per_epoch"]   # the warm-up, the failed capture's, the rest
    for a, b in zip(eager.model.state_dict().values(), graphed.model.state_dict().values()):
        assert torch.equal(a, b)   # no step lost, none taken twice


def test_a_capture_that_fails_with_graphs_asked_for_names_the_operation_and_loses_no_step(
        packed_sample, world, host_read_model, tmp_path):
    asked = config(packed_sample, host_read_model, cuda_graphs=True, checkpoint_dir=str(tmp_path),
                   checkpoint_every=2)
    with pytest.raises(CaptureFailed) as refused:
        Trainer(asked, world, graph_backend=StandIn()).run()
    message = str(refused.value)
    assert "\n" not in message and "the capture of the step's step graph failed at step 4" in message
    assert "host_read.py:13 (if x.abs().max().item() > 1e6:" in message and "leave out `cuda_graphs`" in message
    assert isinstance(refused.value, DimdError)
    resumed = Trainer(config(packed_sample, host_read_model, checkpoint_dir=str(tmp_path), resume=True), world)
    result = resumed.run()
    assert resumed.resumed_from is not None and result.epochs[-1].epoch == 2   # from the checkpoint at step 2


def test_the_device_feed_pauses_while_a_graph_is_captured(store):
    """The feed's thread stages batches as fast as it can; the stand-in's captures take a while: no batch's
    device work (the stage) overlaps a capture."""
    from dimd.shuffle import BatchLoader

    spans: dict[str, list[tuple[float, float]]] = {"stage": [], "capture": []}

    def timed(kind, work):
        start = time.perf_counter()
        time.sleep(0.005)
        out = work()
        spans[kind].append((start, time.perf_counter()))
        return out

    class SlowStandIn(StandIn):
        def capture(self, body, randoms=()):
            return timed("capture", lambda: super(SlowStandIn, self).capture(body, randoms))

    loader = BatchLoader(store, batch_size=4, image_size=12, seed=1)
    feed = DeviceFeed(loader, torch.device("cpu"), stage=lambda batch: timed("stage", lambda: batch), ahead=2)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 10 * 10, 5))
    strategies = [GraphedSSGD(model, make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=0.0),
                              lambda array: None, 1, normalize=lambda x: x.float(), backend=SlowStandIn(), warmup=0)]
    batches = feed.epoch(0)
    for step in range(6):
        if step == 3:   # a re-capture, as after a loaded checkpoint or a new number of learners
            strategies[0].graphs.reset("test")
        strategies[0].step([next(batches)], StepPlace(lr=0.1))
    batches.close()
    loader.close()
    assert len(spans["capture"]) == 2 and len(spans["stage"]) >= 6
    for start, end in spans["capture"]:
        assert all(stage_end <= start or stage_start >= end for stage_start, stage_end in spans["stage"])


def dropout_sma(graph: bool):
    torch.manual_seed(0)   # learner j's random numbers start from seed 0 + j
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 5))
    options = dict(learners=3, alpha=None, momentum=0.9, central_momentum=None, weight_decay=0.0,
                   normalize=lambda x: x.float().div(255))
    if graph:
        sma = GraphedSMA(model, lambda array: None, 1, backend=StandIn(), warmup=1, **options)
    else:
        sma = SMA(model, lambda array: None, 1, **options)
    masks: list[list[torch.Tensor]] = [[] for _ in range(3)]
    for j, replica in enumerate(sma.learner_group.replicas):
        replica[3].register_forward_hook(lambda module, args, out, j=j: masks[j].append(out == 0))
    return sma, masks


def test_learners_draw_their_own_random_numbers_the_same_again_for_the_same_seed():
    generator = torch.Generator().manual_seed(1)
    batches = [[(torch.randint(0, 256, (6, 3, 4, 4), dtype=torch.uint8, generator=generator),
                 torch.randint(0, 5, (6,), generator=generator)) for _ in range(3)] for _ in range(4)]
    runs = []
    for graph in (True, True, False):
        sma, masks = dropout_sma(graph)
        for step in batches:
            sma.step(step, StepPlace(lr=0.05))
        runs.append((sma, masks))
    (graphed, masks), (again, masks_again), (eager, eager_masks) = runs
    assert len(masks[0]) == 4 and graphed.figures()["cuda_graphs"]["replays"] > 0
    for step in range(4):
        assert not torch.equal(masks[0][step], masks[1][step]) and not torch.equal(masks[1][step], masks[2][step])
    for mine, other in ((masks_again, masks), (eager_masks, masks)):   # a replay of the same seed, and eager
        assert all(torch.equal(a, b) for j in range(3) for a, b in zip(mine[j], other[j]))
    assert torch.equal(graphed.z, again.z) and torch.equal(graphed.z, eager.z)


def test_a_reset_takes_a_new_memory_pool_for_the_next_captures():
    backend = StandIn()
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 5))
    sgd = GraphedSSGD(model, make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=0.0), lambda array: None, 1,
                      normalize=lambda x: x.float(), backend=backend, warmup=0)
    batch = (torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64))
    sgd.step([batch], StepPlace(lr=0.1))
    sgd.graphs.reset("learners per rank 1 -> 2")
    sgd.step([batch], StepPlace(lr=0.1))
    assert backend.pools == 2 and [c.reason for c in sgd.graphs.captures] == \
        ["first capture", "learners per rank 1 -> 2"]


def test_an_error_of_the_step_itself_is_raised_as_it_is_not_as_a_capture_failure():
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 5))
    sgd = GraphedSSGD(model, make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=0.0), lambda array: None, 1,
                      backend=StandIn(), warmup=0, fallback=True)   # no normalize: uint8 images meet float weights
    batch = (torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        sgd.step([batch], StepPlace(lr=0.1))
    assert sgd.graphs.failed is None


def test_the_time_split_on_a_gpu_is_read_from_events_once_they_are_done_never_waited_for():
    from dimd.train.steps import PhaseClock, StepTimes

    class Event:   # a CUDA event's stand-in: recorded at a device time, done once the device got there
        device_now = 0.0

        def __init__(self):
            self.at, self.done = Event.device_now, False

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return (end.at - self.at) * 1000.0   # milliseconds, as CUDA's

        def synchronize(self):
            raise AssertionError("the clock must never wait for the device")

    made: list[Event] = []
    clock = PhaseClock(torch.device("cpu"), event=lambda: made.append(Event()) or made[-1])
    for step in range(2):
        clock.start()
        for phase, seconds in (("compute", 0.5), ("allreduce", 0.25), ("optimizer", 0.125)):
            Event.device_now += seconds
            clock.mark(phase)
        times = clock.collect(StepTimes(data=0.01))
        if step == 0:   # the device has not reached the step's marks yet: nothing read, nothing waited for
            assert (times.compute, times.allreduce, times.optimizer) == (0.0, 0.0, 0.0)
            for event in made:
                event.done = True
    assert (times.compute, times.allreduce, times.optimizer) == (0.5, 0.25, 0.125)   # the first step's, read now
    assert times.data == 0.01
