"""The training recipe's pieces against their definitions and in a run: label smoothing is torch's loss, the EMA is
evaluated beside the model and resumes, the target stops and records, LARS under S-SGD and SMA, progressive
resizing epoch by epoch, --compile on two ranks; each bad setting one line naming its flag."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpi_case import case, say, world

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


# -- in a run: the average beside the model, the target's stop and record -------------------------------


def run_config(packed_sample, **options):
    from dimd.train.config import TrainConfig

    settings = dict(model="resnet20", image_size=16, epochs=3, batch_size=8, lr=0.05, lr_scaling=False,
                    schedule="cosine", decode_workers=1, threads=1)
    return TrainConfig(train=str(packed_sample), val=str(packed_sample), **{**settings, **options})


def test_the_ema_is_evaluated_beside_the_model_and_resumes_from_the_checkpoint(packed_sample, world, tmp_path):
    from dimd.train.config import SSGDConfig
    from dimd.train.engine import Trainer

    options = dict(ssgd=SSGDConfig(ema=0.9, ema_every=2), label_smoothing=0.1, checkpoint_dir=str(tmp_path),
                   keep_checkpoints=0)
    straight = Trainer(run_config(packed_sample, **options), world)
    result = straight.run()
    history = [epoch.as_dict() for epoch in result.epochs]
    assert all(0.0 <= line["ema_val_top1"] <= 1.0 and "ema_val_loss" in line for line in history)
    assert history[-1]["ema_val_loss"] != history[-1]["val_loss"]   # another model: the average
    assert all(e.ema_top1 is not None for e in result.evaluations)
    # resumed from the checkpoint after epoch 2, the run ends with the straight run's average, bit for bit
    after_two = sorted(tmp_path.glob("*.pt"))[1]
    options.update(checkpoint_dir=str(tmp_path / "again"), resume_from=str(after_two))
    resumed = Trainer(run_config(packed_sample, **options), world)
    resumed.run()
    assert resumed.resumed_from == str(after_two)
    for a, b in zip(straight.strategy.average.module.state_dict().values(),
                    resumed.strategy.average.module.state_dict().values()):
        assert torch.equal(a, b)


def test_a_run_stops_at_its_target_and_records_when_it_got_there(packed_sample, world):
    from dimd.train.engine import Trainer

    from dimd.train.engine import Hooks

    events: list[str] = []
    trainer = Trainer(run_config(packed_sample, epochs=5, target_top1=1.0), world, hooks=Hooks(on_event=events.append))
    result = trainer.run()
    figures = result.figures()
    target = figures["target"]
    assert result.stopped_by == "target" and target["reached"] and len(result.epochs) == 1   # 1% is met at once
    assert target["top1"] == 1.0 and target["reached_top1"] >= 1.0 and target["by"] == "model"
    assert target["epochs"] == 1 and target["updates"] == result.epochs[0].step and target["seconds"] > 0
    assert result.epochs[-1].as_dict()["target"] == {k: v for k, v in target.items() if k != "reached"}
    assert any("reaches the target 1.00%" in event for event in events)
    missed = Trainer(run_config(packed_sample, epochs=1, target_top1=100.0), world).run().figures()["target"]
    assert missed == {"top1": 100.0, "reached": False}


@pytest.mark.parametrize("field, value, message", [
    ("label_smoothing", 1.0, r"label_smoothing must be in \[0.0, 1.0\)"),
    ("label_smoothing", -0.1, r"label_smoothing must be in \[0.0, 1.0\)"),
    ("target_top1", 0.0, r"target_top1 must be in \(0.0, 100.0\]"),
    ("target_top1", 101.0, r"target_top1 must be in \(0.0, 100.0\]"),
])
def test_recipe_settings_outside_their_range_are_refused_in_one_line(field, value, message):
    from dimd.errors import ConfigError
    from dimd.train.config import SSGDConfig, TrainConfig

    with pytest.raises(ConfigError, match=message):
        TrainConfig(train="t", val="v", **{field: value})
    for decay in (0.0, 1.0):
        with pytest.raises(ConfigError, match=r"ema must be in \(0.0, 1.0\)"):
            SSGDConfig(ema=decay)
    with pytest.raises(ConfigError, match="ema is a setting of S-SGD: SMA's central model z is itself an average"):
        TrainConfig(train="t", val="v", sync="sma", ssgd=SSGDConfig(ema=0.99))


def test_each_sma_learner_steps_as_lars_on_its_own_rows():
    """K learners' LARS step on the flat rows against the formula, layer by layer, learner by learner:
    ratio = eta |w| / (|g| + wd |w|) on weights; biases take no ratio and no decay."""
    import numpy as np

    from dimd.train.learners import LayerTrust

    template = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    eta, wd, lr, mu = 0.01, 1e-3, 0.5, 0.9
    learners = Learners(template, 3, trust=LayerTrust(template, eta, wd))
    from dimd.train.sma import decay_vector

    decay = decay_vector(template, wd)
    generator = torch.Generator().manual_seed(4)
    learners.W.detach().add_(torch.randn(learners.W.shape, generator=generator))
    learners.V.copy_(torch.randn(learners.V.shape, generator=generator))
    learners.G.copy_(torch.randn(learners.G.shape, generator=generator))
    w, v, g = (t.detach().numpy().astype(np.float64).copy() for t in (learners.W, learners.V, learners.G))
    learners.update(None, lr, mu, decay)
    slots = [(0, 12, True), (12, 16, False), (16, 24, True), (24, 26, False)]   # weight, bias, weight, bias
    for j in range(3):
        for start, stop, adapts in slots:
            wj, gj = w[j, start:stop], g[j, start:stop]
            if adapts:
                ratio = eta * np.linalg.norm(wj) / (np.linalg.norm(gj) + wd * np.linalg.norm(wj))
                d = ratio * (gj + wd * wj)
            else:
                d = gj
            vj = mu * v[j, start:stop] - lr * d
            np.testing.assert_allclose(learners.V[j, start:stop].numpy(), vj, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(learners.W.detach()[j, start:stop].numpy(), wj + vj, rtol=1e-5, atol=1e-7)


# -- LARS and progressive resizing in a run ------------------------------------------------------------


def test_lars_trains_under_s_sgd_and_sma_and_a_resume_continues_exactly(packed_sample, world, tmp_path):
    from dimd.train.engine import Trainer
    from dimd.train.lars import LARS

    options = dict(optimizer="lars", lars_trust=0.02, checkpoint_dir=str(tmp_path), keep_checkpoints=0)
    straight = Trainer(run_config(packed_sample, **options), world)
    result = straight.run()
    assert isinstance(straight.strategy.optimizer, LARS) and all(e.train_loss == e.train_loss for e in result.epochs)
    after_two = sorted(tmp_path.glob("*.pt"))[1]
    options.update(checkpoint_dir=str(tmp_path / "again"), resume_from=str(after_two))
    resumed = Trainer(run_config(packed_sample, **options), world)
    resumed.run()
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)   # LARS's momentum came back with the checkpoint
    from dimd.train.config import SMAConfig

    sma = Trainer(run_config(packed_sample, optimizer="lars", sync="sma", sma=SMAConfig(learners=2), epochs=1), world)
    assert sma.run().epochs[0].train_loss > 0 and sma.strategy.learner_group.trust is not None


def test_progressive_resizing_trains_each_epoch_at_its_size_each_size_its_graph(packed_sample, world):
    from dimd.train.engine import Trainer
    from dimd.train.graphs import StandIn

    config = run_config(packed_sample, image_size_schedule="8:16", epochs=2, val_image_size=24)
    trainer = Trainer(config, world, graph_backend=StandIn())
    figures = trainer.run().figures()
    shapes = [capture["shape"] for capture in figures["cuda_graphs"]["captures"]]
    assert shapes == ["8x3x8x8", "8x3x16x16"]   # epoch 0 at 8 px, epoch 1 at 16 px: a graph each
    assert [trainer.loader.image_size_at(epoch) for epoch in (0, 1)] == [8, 16]
    assert trainer.val_loader.image_size == 24


@pytest.mark.parametrize("schedule, message", [
    ("32:16", "must not shrink"),
    ("16:28", "must be in steps of 8 px for resnet20: 28 px is not a multiple of 8"),
    ("16:32:0:9", "after the run's last epoch"),
    ("big", "must be START:END or START:END:FIRST:LAST"),
])
def test_a_size_schedule_that_cannot_run_is_refused_in_one_line_naming_the_flag(schedule, message):
    from dimd.errors import ConfigError
    from dimd.train.config import TrainConfig

    with pytest.raises(ConfigError, match="^image_size_schedule ") as refused:
        TrainConfig(train="t", val="v", model="resnet20", image_size=32, epochs=3, image_size_schedule=schedule)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_bad_optimizer_settings_are_refused_in_one_line():
    from dimd.errors import ConfigError
    from dimd.train.config import TrainConfig

    for options, message in ((dict(optimizer="adam"), "optimizer must be one of sgd, lars"),
                             (dict(optimizer="lars", lars_trust=0.0), "lars_trust must be positive"),
                             (dict(optimizer="lars", precision="16-mixed"), "lars cannot skip an overflowed")):
        with pytest.raises(ConfigError, match=message):
            TrainConfig(train="t", val="v", **options)


TINY_MODEL = '''
from torch import nn


def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))
'''


@case
def compiled_ranks_agree(data: str, model_file: str) -> None:
    """Two ranks train a compiled replica: the buckets' allreduce keeps them bit-identical, and the weights are
    the eager run's within float rounding."""
    from dimd.train.config import SSGDConfig, TrainConfig
    from dimd.train.engine import Trainer

    comm = world()
    results = []
    for compiled in (False, True):
        config = TrainConfig(train=data, val=data, model=f"{model_file}:build", image_size=16, epochs=1,
                             batch_size=4, lr=0.05, lr_scaling=False, decode_workers=1, threads=1, seed=3,
                             allreduce="ring", ssgd=SSGDConfig(compile=compiled, overlap=compiled))
        trainer = Trainer(config, comm)
        result = trainer.run()
        results.append(([t.detach().clone() for t in trainer.model.state_dict().values()], result))
    (eager, _), (compiled, result) = results
    close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(eager, compiled))
    say(json.dumps({"identical": result.replicas_identical, "close": close,
                    "overlap": result.allreduce_choice["overlap"]}))


@pytest.mark.mpi
def test_a_compiled_replica_trains_alike_on_two_ranks_and_stays_identical(packed_sample, tmp_path):
    from conftest import mpi_run

    model_file = tmp_path / "tiny.py"
    model_file.write_text(TINY_MODEL)
    proc = mpi_run(compiled_ranks_agree, 2, str(packed_sample), str(model_file), timeout=240, check=True)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert reports and all(r == {"identical": True, "close": True, "overlap": True} for r in reports)


def test_compile_with_cuda_graphs_or_sma_is_refused_in_one_line():
    from dimd.errors import ConfigError
    from dimd.train.config import SSGDConfig, TrainConfig

    with pytest.raises(ConfigError, match="cuda_graphs cannot go with `compile`"):
        TrainConfig(train="t", val="v", device="cuda", cuda_graphs=True, ssgd=SSGDConfig(compile=True))
    with pytest.raises(ConfigError, match="compile is a setting of S-SGD: SMA's learners are K replicas"):
        TrainConfig(train="t", val="v", sync="sma", ssgd=SSGDConfig(compile=True))


def test_the_weight_average_is_evaluated_again_and_exported_where_it_scored_better(packed_sample, world, tmp_path):
    """dimd eval --ema scores the average as training logged it; export takes the average when the last epoch
    scored it above the model (here made so by editing that record), and meta.json says which."""
    from dimd.train.checkpoint import load_checkpoint, save_checkpoint
    from dimd.train.checkpoint_eval import evaluate_checkpoint, input_problem
    from dimd.train.config import SSGDConfig
    from dimd.train.engine import Trainer
    from dimd.train.eval_config import EvalConfig
    from dimd.train.export import ExportConfig, export_model

    Trainer(run_config(packed_sample, epochs=2, ssgd=SSGDConfig(ema=0.9, ema_every=1),
                       checkpoint_dir=str(tmp_path / "run")), world).run()
    checkpoint = str(sorted((tmp_path / "run").glob("*.pt"))[-1])
    trained, problem = input_problem(EvalConfig(checkpoint=checkpoint, val=str(packed_sample), ema=True), world)
    assert problem is None and trained is not None
    scored = evaluate_checkpoint(EvalConfig(checkpoint=checkpoint, val=str(packed_sample), ema=True,
                                            decode_workers=1), trained, world).result
    logged = load_checkpoint(checkpoint)["history"][-1]
    assert scored.top1 == pytest.approx(logged["ema_val_top1"]) and scored.loss == pytest.approx(logged["ema_val_loss"])

    document = load_checkpoint(checkpoint)
    document["history"][-1].update(val_top1=0.1, ema_val_top1=0.9)   # the average scored better
    better = str(save_checkpoint(tmp_path / "edited", document))
    meta = export_model(ExportConfig(checkpoint=better, out=str(tmp_path / "export")))
    exported = torch.load(tmp_path / "export" / "model.pt", weights_only=True)
    averaged = document["strategy"]["ema"]["averaged"]
    assert "weight average" in meta["weights"] and meta["val_top1"] == 0.9
    assert all(torch.equal(exported[name], averaged[f"module.{name}"]) for name in exported)
