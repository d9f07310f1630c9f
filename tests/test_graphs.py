"""CUDA graphs' bookkeeping, run on the CPU: the graphed steps go through the stand-in that replays the eager
step in place of a captured graph (static inputs the feed's batches are copied into, the rate and the loss
scale as tensors, one capture per shape, records) and give the weights of the plain eager step."""

import copy
import json
import math
from typing import Any

import pytest
import torch
from conftest import mpi_run
from mpi_case import case, reduction, say, world
from torch import nn

from dimd.train.graphed_sgd import GraphedSSGD
from dimd.train.graphed_sma import GraphedSMA
from dimd.train.graphs import MAX_SHAPES, StandIn, capture_problem
from dimd.train.precision import Precision
from dimd.train.sgd import SSGD, make_optimizer, parameter_groups
from dimd.train.sma import SMA
from dimd.train.steps import StepPlace

CPU = torch.device("cpu")


def small_bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))


def normalize(images: torch.Tensor) -> torch.Tensor:
    return images.float().div(255)


def eager(precision="32-true", fused=False, nesterov=False, model=None):
    """The plain eager S-SGD step (fused: torch.optim.SGD's fused kernel, as the graphed step uses)."""
    model = model or small_bn_model()
    optimizer = torch.optim.SGD(parameter_groups(model, 1e-3), lr=0.1, momentum=0.9, nesterov=nesterov,
                                fused=fused or None)
    return SSGD(model, optimizer, lambda array: None, 1, normalize=normalize, precision=Precision(precision, CPU))


def graphed(precision="32-true", nesterov=False, warmup=2, model=None):
    model = model or small_bn_model()
    optimizer = make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    return GraphedSSGD(model, optimizer, lambda array: None, 1, normalize=normalize,
                       precision=Precision(precision, CPU), backend=StandIn(), warmup=warmup)


def batches(sizes, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for n in sizes:
        yield (torch.randint(0, 256, (n, 3, 12, 12), dtype=torch.uint8, generator=generator),
               torch.randint(0, 5, (n,), generator=generator))


def state(strategy) -> list[torch.Tensor]:
    return [t.detach() for t in list(strategy.model.parameters()) + list(strategy.model.buffers())]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(state(a), state(b)))


def run(strategies, sizes, lr=lambda step: 0.1 * 0.8 ** step):
    results = []
    for step, batch in enumerate(batches(sizes)):
        results.append([s.step([batch], StepPlace(lr=lr(step))) for s in strategies])
    return results


@pytest.mark.parametrize("precision, nesterov", [("32-true", False), ("32-true", True), ("bf16-mixed", False),
                                                 ("16-mixed", False)])
def test_a_graphed_step_gives_the_weights_of_the_eager_step(precision, nesterov):
    """Bit for bit against the eager step with the same (fused) optimizer kernel, a changing rate, warm-up steps,
    the capture and replays; within float32 rounding of torch.optim.SGD's default per-tensor kernel, which
    rounds the momentum update twice where the fused kernel rounds once."""
    reference, default, graph = eager(precision, fused=True, nesterov=nesterov), \
        eager(precision, nesterov=nesterov), graphed(precision, nesterov)
    for ours, theirs, _ in run([graph, reference, default], [8] * 6):
        assert (ours.loss_sum, ours.correct, ours.samples, ours.finite) == \
            (theirs.loss_sum, theirs.correct, theirs.samples, theirs.finite)
    assert same(graph, reference)
    for a, b in zip(state(graph), state(default)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    records = graph.figures()["cuda_graphs"]
    assert [(c["graph"], c["shape"], c["reason"], c["step"]) for c in records["captures"]] == \
        [("step", "8x3x12x12", "first capture", 3)]
    assert (records["eager_runs"], records["replays"], records["recaptures"]) == (2, 4, 0)


def test_the_rate_and_the_loss_scale_are_tensors_the_captured_step_reads():
    graph, reference = graphed("16-mixed"), eager("16-mixed", fused=True)
    run([graph, reference], [8] * 4, lr=lambda step: 0.05 * (step + 1))
    assert float(graph.lr) == pytest.approx(0.2) and len(graph.graphs.captures) == 1
    for strategy in (graph, reference):      # a scale float16 gradients cannot stand: steps are skipped, on the device
        strategy.precision.loss_scale.scale = 2.0 ** 40
        strategy.precision.refresh()
    before = [t.clone() for t in state(graph)]
    (first, expected), = run([graph, reference], [8])
    assert first.finite and expected.finite and any("skipped" in event for event in first.events)
    assert all(torch.equal(a, b) for a, b in zip(before[:3], state(graph)[:3]))   # weights untouched
    assert float(graph.precision.scale) == graph.precision.loss_scale.scale == 2.0 ** 39
    run([graph, reference], [8] * 30)         # halved until it fits, each scale read from the tensor by one capture
    assert same(graph, reference) and len(graph.graphs.captures) == 1
    assert graph.precision.loss_scale.skipped == reference.precision.loss_scale.skipped > 1
    assert float(graph.precision.scale) == graph.precision.loss_scale.scale < 2.0 ** 39


def test_a_last_batch_of_another_size_is_captured_once_and_recorded():
    graph, reference = graphed(warmup=1), eager(fused=True)
    run([graph, reference], [8, 8, 6, 6, 8, 6, 8, 6])
    assert same(graph, reference)
    captures = graph.figures()["cuda_graphs"]["captures"]
    assert [(c["shape"], c["reason"], c["step"]) for c in captures] == \
        [("8x3x12x12", "first capture", 2), ("6x3x12x12", "new batch shape", 4)]
    assert graph.figures()["cuda_graphs"]["recaptures"] == 1


def test_shapes_beyond_the_limit_run_eagerly_and_say_so_once():
    graph, reference = graphed(warmup=0), eager(fused=True)
    sizes = list(range(2, 2 + MAX_SHAPES + 3))
    results = run([graph, reference], sizes + sizes)
    assert same(graph, reference)
    said = [event for ours, _ in results for event in ours.events]
    assert len(said) == 1 and f"kept for {MAX_SHAPES} shapes" in said[0]
    assert len(graph.graphs.captures) == MAX_SHAPES and graph.graphs.eager_runs == 6


def test_the_device_feed_writes_each_batch_into_the_graphs_inputs(store):
    from dimd.shuffle import BatchLoader
    from dimd.shuffle.device_feed import DeviceFeed

    graph, reference = graphed(warmup=1), eager(fused=True)
    feed = DeviceFeed(BatchLoader(store, batch_size=4, image_size=12, seed=3), CPU, ahead=2)   # a feeding thread
    addresses = set()
    for images, labels in feed.epoch(0):
        for strategy in (graph, reference):
            strategy.step([(images, labels)], StepPlace(lr=0.1))
        (static,), = graph.inputs._by_key.values()
        addresses.add(static.images.data_ptr())
        assert torch.equal(static.images, images) and torch.equal(static.labels, labels)
    feed.close()
    assert len(addresses) == 1 and same(graph, reference)


def test_a_checkpoint_moves_between_graphed_and_eager_steps():
    """A graphed run's checkpoint holds the optimizer as the eager step saves it (the rate a number, not the
    tensor the step reads); either kind resumes from either kind's checkpoint."""
    graph, reference = graphed(warmup=1), eager(fused=True)
    run([graph, reference], [8] * 3)
    saved = copy.deepcopy(graph.global_state())   # as torch.save and torch.load would give it back
    assert all(isinstance(group["lr"], float) for group in saved["optimizer"]["param_groups"])
    resumed_eager, resumed_graph = eager(), graphed(warmup=1)
    for strategy in (resumed_eager, resumed_graph):
        strategy.model.load_state_dict(graph.model.state_dict())
        strategy.load_state(copy.deepcopy(saved), graph.local_state())
    graph.load_state(copy.deepcopy(reference.global_state()), reference.local_state())   # an eager checkpoint
    run([graph, reference, resumed_eager, resumed_graph], [8] * 3)
    assert same(graph, reference) and same(resumed_graph, reference)
    assert same(resumed_eager, reference)   # one step body: the same bits, eager or graphed
    assert [c["reason"] for c in graph.figures()["cuda_graphs"]["captures"]] == \
        ["first capture", "a checkpoint was loaded"]
    assert [c["reason"] for c in resumed_graph.figures()["cuda_graphs"]["captures"]] == ["first capture"]


def test_a_model_a_graph_cannot_replay_is_named_in_one_line():
    model = small_bn_model()
    assert capture_problem(model) is None
    model[1].momentum = None
    problem = capture_problem(model)
    assert problem.startswith("batch norm 1 has momentum=None") and "cannot replay" in problem
    with pytest.raises(ValueError, match="momentum=None"):
        graphed(model=model)


@pytest.mark.parametrize("sync", ["ssgd", "sma"])
def test_the_training_engine_runs_graphed_steps_on_the_stand_in(packed_sample, world, sync):
    """dimd train's loop with graphed steps (the stand-in in place of the GPU): the same weights as the eager
    run, bit for bit (one step body), the captures in the JSON."""
    from dimd.train.config import SMAConfig, TrainConfig
    from dimd.train.engine import Trainer

    options = dict(precision="bf16-mixed") if sync == "ssgd" else dict(sync="sma", sma=SMAConfig(learners=2))
    config = TrainConfig(train=str(packed_sample), val=str(packed_sample), model="resnet20", image_size=16,
                         epochs=2, batch_size=8, lr=0.05, lr_scaling=False, schedule="cosine", decode_workers=1,
                         threads=1, **options)
    runs = []
    for backend in (None, StandIn()):
        trainer = Trainer(config, world, graph_backend=backend)
        runs.append((trainer.run().figures(), trainer.model))
    (eager_figures, eager_model), (graph_figures, graph_model) = runs
    for a, b in zip(eager_model.state_dict().values(), graph_model.state_dict().values()):
        assert torch.equal(a, b)   # one step body: eager and graphed give the same bits
    assert eager_figures["cuda_graphs"] == {"on": False, "rule": "off: the device is not a GPU"}
    graphs = graph_figures["cuda_graphs"]
    assert graphs["on"] and graphs["backend"] == "stand-in" and graphs["rule"].startswith("on: stand-in")
    assert {c["reason"] for c in graphs["captures"]} == {"first capture"} and graphs["recaptures"] == 0
    assert [c["graph"] for c in graphs["captures"]] == \
        (["step"] if sync == "ssgd" else ["learner 0", "learner 1", "update", "sync"])   # loop: one per learner
    steps = 2 * graph_figures["steps_per_epoch"]
    assert graphs["replays"] + graphs["eager_runs"] == steps * len(graphs["captures"])
    assert math.isclose(graph_figures["final"]["train_loss"], eager_figures["final"]["train_loss"], rel_tol=1e-4)


# -- SMA's learners ---------------------------------------------------------------------------------


def sma(graph=False, compute="branches", k=3, warmup=2, **options):
    settings = dict(learners=k, alpha=None, momentum=0.9, central_momentum=0.5, weight_decay=1e-3,
                    normalize=normalize, **options)
    if graph:
        return GraphedSMA(small_bn_model(), lambda array: None, 1, backend=StandIn(), warmup=warmup,
                          compute=compute, **settings)
    return SMA(small_bn_model(), lambda array: None, 1, **settings)


def learner_batches(k, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, 256, (6, 3, 12, 12), dtype=torch.uint8, generator=generator),
              torch.randint(0, 5, (6,), generator=generator)) for _ in range(k)] for _ in range(steps)]


def same_sma(a, b) -> bool:
    ga, gb = a.learner_group, b.learner_group
    return all(torch.equal(x, y) for x, y in ((a.z, b.z), (a.delta_prev, b.delta_prev), (ga.W, gb.W), (ga.V, gb.V),
                                              (ga.B, gb.B), (ga.C, gb.C)))


@pytest.mark.parametrize("compute", ["branches", "loop"])
@pytest.mark.parametrize("sync_every", [1, 2])
def test_graphed_learners_give_the_eager_learners_weights(compute, sync_every):
    """K learners as one graph of K branches or K graphs, and the synchronisation as a graph: z, every learner's
    weights, momentum and batch-norm statistics bit for bit the eager strategy's, over warm-up, capture and
    replays with a changing rate."""
    eager, graph = sma(sync_every=sync_every), sma(graph=True, compute=compute, sync_every=sync_every)
    for step, batches in enumerate(learner_batches(3, 8)):
        ours, theirs = (s.step(batches, StepPlace(lr=0.1 * 0.9 ** step)) for s in (graph, eager))
        assert (ours.loss_sum, ours.correct, ours.samples, ours.synced, ours.finite) == \
            (theirs.loss_sum, theirs.correct, theirs.samples, theirs.synced, theirs.finite)
        assert ours.synced == ((step + 1) % sync_every == 0)
    assert same_sma(graph, eager)
    captures = graph.figures()["cuda_graphs"]["captures"]
    learners = ["learners"] if compute == "branches" else ["learner 0", "learner 1", "learner 2"]
    assert [c["graph"] for c in captures] == learners + ["update", "sync"]
    assert {c["reason"] for c in captures} == {"first capture"} and captures[0]["shape"] == "3 x 6x3x12x12"
    assert captures[-1]["step"] == 3 * sync_every   # the synchronisation's third run


def test_a_new_number_of_learners_drops_the_graphs_and_captures_them_again():
    eager, graph = sma(k=2), sma(graph=True, k=2, warmup=1)
    for step, batches in enumerate(learner_batches(3, 6)):
        if step == 3:
            for strategy in (eager, graph):
                strategy.learner_group.resize(3)
        for strategy in (eager, graph):
            strategy.step(batches[:strategy.learners], StepPlace(lr=0.05))
    assert same_sma(graph, eager)
    assert [(c["graph"], c["step"], c["reason"]) for c in graph.figures()["cuda_graphs"]["captures"]] == \
        [("learners", 2, "first capture"), ("update", 2, "first capture"), ("sync", 2, "first capture"),
         ("learners", 5, "learners per rank 2 -> 3"), ("update", 5, "learners per rank 2 -> 3"),
         ("sync", 5, "learners per rank 2 -> 3")]
    assert graph.figures()["cuda_graphs"]["recaptures"] == 3


def test_the_auto_tuners_window_counts_only_steps_after_the_captures():
    graph = sma(graph=True, k=None, warmup=2)
    counted = []
    for batches in learner_batches(1, 5):
        graph.step(batches[:graph.learners], StepPlace(lr=0.05))
        counted.append(graph._window_images)
    assert counted == [0, 0, 0, 6, 12]   # two warm-up steps and the capture's step count nothing


def test_a_graphed_sma_checkpoint_resumes_with_new_graphs():
    eager, graph = sma(), sma(graph=True, warmup=1)
    steps = learner_batches(3, 6)
    for batches in steps[:3]:
        for strategy in (eager, graph):
            strategy.step(batches, StepPlace(lr=0.05))
    resumed = sma(graph=True, warmup=1)
    resumed.model.load_state_dict(graph.model.state_dict())
    resumed.load_state(copy.deepcopy(graph.global_state()), copy.deepcopy(graph.local_state()))
    graph.load_state(copy.deepcopy(eager.global_state()), copy.deepcopy(eager.local_state()))
    for batches in steps[3:]:
        for strategy in (eager, graph, resumed):
            strategy.step(batches, StepPlace(lr=0.05))
    assert same_sma(graph, eager) and same_sma(resumed, eager)
    reasons = [c["reason"] for c in graph.figures()["cuda_graphs"]["captures"]]
    assert reasons == ["first capture"] * 3 + ["a checkpoint was loaded"] * 3


@case
def graphed_steps_on_ranks(*algorithms: str) -> None:
    """Graphed S-SGD (two graphs around the gradients' reduction) and graphed SMA (the synchronisation's two
    graphs around Delta's) on P ranks, through the CPU stand-in, against the eager strategies fed the same
    batches; in 16-mixed, rank 1 overflows once and every rank skips in the graph. Per algorithm: a host one
    (ring: the sums go through host buffers), or gloo (torch.distributed's group, in place on the tensors'
    device between the graphs: the path NCCL takes on a GPU).

    Rank 0 prints one JSON line per algorithm: whether each graphed run's weights equal the eager run's bit
    for bit, the parts captured, and whether the replicas agree.
    """
    comm = world()
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, 255, (4, 3, 16, 16), dtype=torch.uint8, generator=g).float(),
                torch.randint(0, 5, (4,), generator=g)) for _ in range(12)]
    batches[3][0][0, 0, 0, 0] = float("inf") if rank == 1 else 0.0   # S-SGD's fourth step (SMA steps on 4-11)
    for algorithm in algorithms:
        figures = graphed_against_eager(algorithm, comm, batches)
        everyone = comm.gather(figures)
        if rank == 0:
            say(json.dumps({**figures, "ranks_agree": all(f == figures for f in everyone)}))


def graphed_against_eager(algorithm: str, comm: Any, batches: list) -> dict[str, Any]:
    """Collective: graphed and eager S-SGD, then SMA, fed ``batches`` and reducing with ``algorithm``."""
    size = comm.Get_size()
    host_reduce, group = reduction(algorithm, comm)
    host_sums = []

    def reduce(array: Any) -> None:
        host_sums.append(array.size)
        host_reduce(array)

    def ssgd(graphed: bool) -> Any:
        torch.manual_seed(0)
        model = small_bn_model()
        precision = Precision("16-mixed", torch.device("cpu"))
        if graphed:
            return GraphedSSGD(model, make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-3), reduce, size,
                               precision=precision, backend=StandIn(), warmup=1, device_reduce=group)
        optimizer = torch.optim.SGD(parameter_groups(model, 1e-3), lr=0.1, momentum=0.9, fused=True)
        return SSGD(model, optimizer, reduce, size, precision=precision, device_reduce=group)

    def sma(graphed: bool) -> Any:
        torch.manual_seed(0)
        options = dict(learners=2, alpha=None, momentum=0.9, central_momentum=0.5, weight_decay=1e-3,
                       device_reduce=group)
        if graphed:
            return GraphedSMA(small_bn_model(), reduce, size, backend=StandIn(), warmup=1, **options)
        return SMA(small_bn_model(), reduce, size, **options)

    figures: dict[str, Any] = {"algorithm": algorithm}
    for name, make in (("ssgd", ssgd), ("sma", sma)):
        eager, graphed = make(False), make(True)
        for step in range(4):
            lr = 0.05 * (step + 1)
            if name == "ssgd":
                for strategy in (eager, graphed):
                    strategy.step([batches[step]], StepPlace(lr=lr))
            else:
                for strategy in (eager, graphed):
                    strategy.step(batches[4 + 2 * step: 6 + 2 * step], StepPlace(lr=lr))
        same = all(a.numpy().tobytes() == b.numpy().tobytes()   # rank 1's statistics are NaN after its inf
                   for a, b in zip(eager.model.state_dict().values(), graphed.model.state_dict().values()))
        captures = graphed.figures()["cuda_graphs"]["captures"]
        figures[name] = {"same": same, "parts": [c["graph"] for c in captures], "identical": graphed.identical(comm)}
        if name == "ssgd":
            figures[name]["skipped"] = graphed.precision.loss_scale.skipped
        for strategy in (eager, graphed):
            strategy.close()
    if group is not None:
        group.close()
    figures["host_sums"] = bool(host_sums)
    return figures


@pytest.mark.mpi
def test_graphed_steps_on_ranks_match_the_eager_ones():
    """Two graphs around the reduction (S-SGD's forward and update, SMA's share and apply) on 3 ranks: over a
    host algorithm, and on the device through torch.distributed's group (gloo here, NCCL on GPUs)."""
    proc = mpi_run(graphed_steps_on_ranks, 3, "ring", "gloo", timeout=180, check=True)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [report["algorithm"] for report in reports] == ["ring", "gloo"]
    for report in reports:
        assert report["ranks_agree"] and report["host_sums"] == (report["algorithm"] == "ring")
        assert report["ssgd"] == {"same": True, "parts": ["forward", "update"], "identical": True, "skipped": 1}
        assert report["sma"] == {"same": True, "parts": ["learner 0", "learner 1", "update", "share", "apply"],
                                 "identical": True}


@case
def graphed_training_on_the_device_group(data: str) -> None:
    """``dimd train``'s loop on P ranks with ``allreduce`` gloo, eager and with graphed steps (the stand-in in
    place of the GPU): the graphed step is two graphs with the buckets reduced between them on the device group
    that the trainer started from MPI (NCCL's on GPUs). Rank 0 prints one JSON line: the largest weight
    difference from the eager run (whose optimizer is torch.optim.SGD's per-tensor kernel, not the fused one),
    the parts captured, the allreduce and overlap, and whether the replicas agree."""
    from dimd.train.config import TrainConfig
    from dimd.train.engine import Trainer

    comm = world()
    config = TrainConfig(train=data, val=data, model="lenet", image_size=16, epochs=2, batch_size=8, lr=0.05,
                         lr_scaling=False, decode_workers=1, threads=1, allreduce="gloo", precision="16-mixed")
    runs = []
    for backend in (None, StandIn()):
        trainer = Trainer(config, comm, graph_backend=backend)
        runs.append((trainer.run().figures(), trainer.model))
    (eager, eager_model), (graphed, graphed_model) = runs
    difference = max(float((a - b).abs().max()) for a, b in
                     zip(eager_model.state_dict().values(), graphed_model.state_dict().values()))
    graphs = graphed["cuda_graphs"]
    if comm.Get_rank() == 0:
        say(json.dumps({"difference": difference, "parts": sorted({c["graph"] for c in graphs["captures"]}),
                        "allreduce": [eager["allreduce"], graphed["allreduce"]],
                        "overlap": [eager["allreduce_choice"]["overlap"], graphed["allreduce_choice"]["overlap"]],
                        "identical": graphed["replicas_identical"], "steps": 2 * graphed["steps_per_epoch"],
                        "runs": graphs["replays"] + graphs["eager_runs"]}))


@pytest.mark.mpi
def test_graphed_training_reduces_between_its_graphs_on_the_device_group(packed_sample):
    proc = mpi_run(graphed_training_on_the_device_group, 2, packed_sample, timeout=240, check=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["allreduce"] == ["gloo", "gloo"] and report["parts"] == ["forward", "update"]
    assert report["overlap"][1] is False and report["identical"]
    assert report["runs"] == 2 * report["steps"]   # each step: forward, then update
    assert report["difference"] < 1e-4


# -- the command line ---------------------------------------------------------------------------------


def test_cuda_graphs_that_cannot_run_are_refused_in_one_line(packed_sample):
    from conftest import run_dimd

    from dimd.errors import ConfigError
    from dimd.train.config import SMAConfig, SSGDConfig, TrainConfig

    common = ["train", packed_sample, "--val", packed_sample, "--model", "lenet", "--image-size", "32",
              "--epochs", "1", "--decode-workers", "1", "--cuda-graphs"]
    proc = run_dimd(*common, "--device", "cpu", timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "'--cuda-graphs/--no-cuda-graphs': replays the step's CUDA work, so it needs a GPU, and this run's " \
           "device is the CPU; leave it out" in proc.stderr
    if not torch.cuda.is_available():   # device auto finds no GPU: refused before the data loads
        proc = run_dimd(*common, timeout=120)
        assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
        assert "--cuda-graphs/--no-cuda-graphs replays the step's CUDA work, so it needs a GPU, and this run's " \
               "device is the CPU" in proc.stderr
        assert "loaded" not in proc.stdout
    for conflict, flag in ((dict(ssgd=SSGDConfig(overlap=True)), "cuda_graphs"),
                           (dict(sync="sma", sma=SMAConfig(learner_compute="threads")), "cuda_graphs")):
        with pytest.raises(ConfigError, match=f"^{flag} cannot go with"):
            TrainConfig(train="t", val="v", cuda_graphs=True, **conflict)
    with pytest.raises(ConfigError, match="branches is one CUDA graph with a branch per learner"):
        TrainConfig(train="t", val="v", sync="sma", sma=SMAConfig(learner_compute="branches"), cuda_graphs=False)
