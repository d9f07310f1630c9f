"""SMA on one process: the update against a hand computation, the mean property, restarts,
the learners' gradient computations against plain modules, and the auto-tuner's decisions."""

import zlib

import numpy as np
import pytest
import torch
from test_train_sma import small_bn_model
from torch import nn

from dimd.train.autotune import AutoTuner
from dimd.train.learners import Learners
from dimd.train.models import build_model
from dimd.train.sma import SMA
from dimd.train.steps import StepPlace


class Tiny(nn.Module):
    """A 2-layer net: one weight matrix (decayed) and one bias (exempt), no batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x.flatten(1))


def make(model):
    return small_bn_model(5) if model == "tinybn" else build_model(model, 5)


def tiny_sma(k, world=1, **options):
    torch.manual_seed(0)
    return SMA(Tiny(), lambda array: None, world, learners=k, **options)


def flat_z(sma):
    return sma.z.numpy().astype(np.float64)


def test_one_synchronisation_equals_the_update_computed_by_hand():
    """Learner step with weight decay and momentum, pre-step corrections, central momentum: twice."""
    k, lr, mu, wd, alpha, mu_c = 3, 0.1, 0.9, 0.01, 0.3, 0.9
    sma = tiny_sma(k, alpha=alpha, momentum=mu, central_momentum=mu_c, weight_decay=wd)
    group = sma.learner_group
    n = sma.z.numel()
    decay = np.array([wd] * 6 + [0.0] * 2)          # fc.weight (2x3) decayed, fc.bias exempt
    rng = np.random.default_rng(1)
    # learners that already differ from z, as after some steps
    with torch.no_grad():
        group.W.detach().add_(torch.from_numpy(rng.normal(0, 0.1, (k, n)).astype(np.float32)))
    w = group.W.detach().numpy().astype(np.float64).copy()
    z = flat_z(sma)
    v = np.zeros((k, n))
    delta_prev = np.zeros(n)
    for _ in range(2):
        g = rng.normal(0, 1, (k, n))
        group.G.copy_(torch.from_numpy(g.astype(np.float32)))
        group.update(None, lr, mu, sma.decay)
        result = sma.synchronize(stop=False)
        # by hand
        g = g + decay * w
        v = mu * v - lr * g
        pre = w.copy()
        w = w + v
        d = pre - z
        w = w - alpha * d
        delta = alpha * d.sum(axis=0) + mu_c * delta_prev
        delta_prev = delta
        z = z + delta
        assert result.synced and result.finite
        np.testing.assert_allclose(group.W.detach().numpy(), w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(flat_z(sma), z, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(group.V.numpy(), v, rtol=1e-5, atol=1e-6)
    assert sma.syncs == 2 and not np.allclose(delta_prev, 0)


def test_with_alpha_one_over_l_and_no_momentum_z_becomes_the_mean_of_the_pre_step_weights():
    k = 4
    sma = tiny_sma(k, alpha=None, momentum=0.0, central_momentum=None, weight_decay=0.0)
    assert sma.alpha == 1 / k and sma.central_momentum == 0.0
    group = sma.learner_group
    with torch.no_grad():
        group.W.detach().add_(torch.randn_like(group.W))
    pre = group.W.detach().clone()
    group.G.normal_()
    group.update(None, 0.5, 0.0, None)
    sma.synchronize(stop=False)
    torch.testing.assert_close(sma.z, pre.mean(dim=0), rtol=1e-6, atol=1e-6)


def test_a_restart_sets_every_learner_to_z_and_keeps_the_momentum():
    sma = tiny_sma(3, alpha=0.2, momentum=0.9, central_momentum=None, weight_decay=0.0)
    group = sma.learner_group
    for _ in range(3):
        group.G.normal_()
        group.update(None, 0.1, 0.9, None)
        sma.synchronize(stop=False)
    assert not torch.equal(group.W.detach()[0], sma.z)
    momentum = group.V.clone()
    sma.restart()
    for j in range(3):
        assert torch.equal(group.W.detach()[j], sma.z)
    assert torch.equal(group.V, momentum) and sma.restarts == 1


def test_sma_synchronises_every_t_steps_and_at_each_epochs_end_and_restarts_past_a_milestone():
    """SMA keeps its own cadence from where each step falls; a checkpoint of it continues the cadence."""
    x = torch.randn(2, 3)
    batches = [(x, torch.tensor([0, 1])), (x, torch.tensor([1, 1]))]
    # two epochs of 4 steps; the schedule passes a milestone before step 5
    places = [StepPlace(lr=0.1, step=i, epoch=i / 4, phase=int(i >= 5), last=i % 4 == 3) for i in range(8)]
    sma = tiny_sma(2, alpha=0.5, momentum=0.0, central_momentum=0.0, weight_decay=0.0, sync_every=3)
    results = [sma.step(batches, place) for place in places]
    assert [r.synced for r in results] == [False, False, True, True, False, False, True, True]
    assert sma.restarts == 1 and sma.syncs == 4
    assert [r.events for r in results if r.events] == [
        ["restart at step 5 (epoch 1.25): the learning rate drops to 0.1, every learner starts again from "
         "the central model"]]
    # a checkpoint after step 4 (one step since the last synchronisation, no milestone passed yet)
    first = tiny_sma(2, alpha=0.5, momentum=0.0, central_momentum=0.0, weight_decay=0.0, sync_every=3)
    for place in places[:5]:
        first.step(batches, place)
    resumed = tiny_sma(2, alpha=0.5, momentum=0.0, central_momentum=0.0, weight_decay=0.0, sync_every=3)
    resumed.model.load_state_dict(first.model.state_dict())   # z, as a checkpoint restores it
    resumed.load_state(first.global_state(), first.local_state())
    assert [resumed.step(batches, place).synced for place in places[5:]] == [False, True, True]
    assert resumed.restarts == 1 and torch.equal(resumed.z, sma.z)


def test_the_central_model_is_the_modules_own_weights():
    """z is the model that is evaluated: its parameters are views of the flat z."""
    sma = tiny_sma(2, alpha=0.5, momentum=0.0, central_momentum=0.0, weight_decay=0.0)
    sma.learner_group.G.normal_()
    sma.learner_group.update(None, 1.0, 0.0, None)
    sma.learner_group.G.normal_()
    sma.learner_group.update(None, 1.0, 0.0, None)
    sma.synchronize(stop=False)
    weights = torch.cat([p.detach().reshape(-1) for p in sma.eval_model().parameters()])
    assert torch.equal(weights, sma.z)


def test_a_non_finite_update_is_reported_on_the_synchronisation():
    sma = tiny_sma(2, alpha=0.5, momentum=0.0, central_momentum=0.0, weight_decay=0.0)
    sma.learner_group.G.fill_(float("inf"))
    sma.learner_group.update(None, 1.0, 0.0, None)
    assert not sma.synchronize(stop=False).finite


@pytest.mark.parametrize("model", ["lenet", "tinybn"])
@pytest.mark.parametrize("compute", ["loop", "threads"])
def test_every_compute_gives_each_learner_the_gradient_of_its_own_batch(model, compute):
    """K learners at different weights, each on its own batch: the gradients and batch-norm
    statistics of K plain modules."""
    torch.manual_seed(3)
    k, b = 3, 2
    template = make(model)
    group = Learners(template, k, compute=compute, threads=2)
    with torch.no_grad():
        group.W.detach().add_(0.01 * torch.randn_like(group.W))
    images = [torch.randint(0, 255, (b, 3, 32, 32), dtype=torch.uint8) for _ in range(k)]
    labels = [torch.randint(0, 5, (b,)) for _ in range(k)]
    _, stats = group.gradients(images, labels)
    for j in range(k):
        plain = make(model).train()
        group.layout.bind(plain, group.W.detach()[j].clone(), group.layout.flat_floats(template).clone(),
                          group.layout.flat_counts(template).clone())
        for p in plain.parameters():
            p.requires_grad_(True)
        logits = plain(images[j].float())
        loss = nn.functional.cross_entropy(logits, labels[j])
        grads = torch.autograd.grad(loss, list(plain.parameters()))
        expected = torch.cat([g.reshape(-1) for g in grads])
        torch.testing.assert_close(group.G[j], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stats[j, 0], loss.detach() * b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(group.float_rows()[j], group.layout.flat_floats(plain), rtol=1e-5, atol=1e-6)
    group.close()


def test_resize_adds_copies_of_learner_zero_and_drops_the_last():
    torch.manual_seed(0)
    group = Learners(small_bn_model(3), 2)
    with torch.no_grad():
        group.W.detach()[1].add_(1.0)
    group.V[0].fill_(0.5)
    group.resize(4)
    assert group.k == 4 and group.W.shape[0] == 4
    assert torch.equal(group.W.detach()[2], group.W.detach()[0]) and torch.equal(group.V[3], group.V[0])
    assert not torch.equal(group.W.detach()[1], group.W.detach()[0])
    group.resize(1)
    assert group.k == 1 and torch.equal(group.V[0], torch.full_like(group.V[0], 0.5))


def test_the_auto_tuner_adds_adds_backs_off_and_freezes():
    tuner = AutoTuner(threshold=0.1)
    decisions = [tuner.observe(t) for t in (100.0, 150.0, 160.0, 300.0, 50.0)]
    assert [d.learners_after for d in decisions[:3]] == [2, 3, 2]
    assert [d.change for d in decisions[:3]] == [1, 1, -1]
    assert decisions[0].rise is None and decisions[1].rise == pytest.approx(0.5)
    assert decisions[2].frozen and decisions[3] is None and decisions[4] is None
    assert tuner.learners == 2 and tuner.frozen
    assert "removing one: 2 per rank; tuning stops" in decisions[2].describe()
    restored = AutoTuner.from_state(tuner.state_dict())
    assert restored == tuner


def test_the_auto_tuner_never_goes_below_one_learner_or_above_its_cap():
    tuner = AutoTuner(threshold=0.1, max_learners=2)
    assert tuner.observe(10.0).learners_after == 2
    assert tuner.observe(100.0).frozen and tuner.learners == 2     # a rise, but no room: keep
    falls = AutoTuner(threshold=0.1)
    falls.observe(10.0)
    assert falls.observe(9.0).learners_after == 1


def test_a_stop_request_rides_the_synchronisation_and_learner_steps_without_one_report_nothing():
    sma = tiny_sma(2, alpha=0.5, momentum=0.0, central_momentum=0.0, weight_decay=0.0, sync_every=2)
    x = torch.randn(2, 3)
    batches = [(x, torch.tensor([0, 1])), (x, torch.tensor([1, 1]))]
    local = sma.step(batches, StepPlace(lr=0.1), stop=True)
    assert not local.synced and not local.stop and local.samples == 0
    synced = sma.step(batches, StepPlace(lr=0.1), stop=True)
    assert synced.synced and synced.stop and synced.samples == 8 and sma.syncs == 1   # both steps counted


def test_recomputed_batch_norm_statistics_are_those_of_every_ranks_batches():
    """Two ranks' batches through a batch-norm layer: the pooled mean is the mean of all images and
    the variance the mixture's (each rank's average batch variance plus the spread of the means)."""
    from dimd.train.batchnorm import recompute_batch_norm

    g = torch.Generator().manual_seed(0)
    ranks = [[torch.randn(8, 3, 4, 4, generator=g) * (1 + r) + 3 * r for _ in range(2)] for r in range(2)]
    other: list[np.ndarray] = []

    def measure(batches, reduce):
        model = nn.Sequential(nn.BatchNorm2d(3, momentum=0.1))
        model.train()
        images = recompute_batch_norm(model, [(x, None) for x in batches], lambda x: x, reduce, world_size=2)
        assert images == 16 and model.training and model[0].momentum == 0.1
        assert int(model[0].num_batches_tracked) == 0                 # left as it was
        return model[0]

    measure(ranks[1], lambda array: other.append(array.copy()))       # what rank 1 puts in the allreduce
    layer = measure(ranks[0], lambda array: np.add(array, other[0], out=array))
    per_rank = [(torch.cat(b).mean(dim=(0, 2, 3)),
                 torch.stack([x.var(dim=(0, 2, 3)) for x in b]).mean(dim=0)) for b in ranks]
    mean = sum(m for m, _ in per_rank) / 2
    variance = sum(v + m * m for m, v in per_rank) / 2 - mean * mean
    torch.testing.assert_close(layer.running_mean, mean)
    torch.testing.assert_close(layer.running_var, variance)
    assert (layer.running_var > torch.stack([v for _, v in per_rank]).max(dim=0).values).all()   # the spread counts


def test_calibration_batches_come_from_the_training_loaders_workers_and_leave_its_batches_as_they_were(store):
    """z's recompute draws through a loader of its own seed that shares the training loader's decoding
    workers: mid-epoch, the training batches go on as a loader that never lent them, and a draw is
    the same whenever it is made (a resumed run recomputes the same statistics)."""
    from dimd.shuffle import BatchLoader
    from dimd.train.batchnorm import CalibrationBatches

    def crcs(batches):
        return [(zlib.crc32(images.numpy().tobytes()), labels.tolist()) for images, labels in batches]

    training = BatchLoader(store, batch_size=4, image_size=16, decode_workers=2, seed=0)
    epoch = training.epoch(0)
    got = crcs(next(epoch) for _ in range(3))
    with BatchLoader(store, batch_size=4, image_size=16, decode_workers=2, seed=0) as alone:
        expected = crcs(alone.epoch(0))
    with BatchLoader(store, batch_size=4, image_size=16, decode_workers=2, seed=1) as other_seed:
        drawn = crcs(other_seed.epoch(5))[:3]
    calibration = CalibrationBatches(BatchLoader(store, batch_size=4, image_size=16, decode_workers=2, seed=1))
    assert crcs(calibration(5, 10)) == drawn                    # the first 3 batches of draw 5
    assert calibration.loader.worker_pids == training.worker_pids and calibration.loader.position == (5, 3)
    got += crcs(next(epoch) for _ in range(3))
    assert crcs(calibration(5, 12)) == drawn
    got += crcs(epoch)
    assert got == expected and training.position == (1, 0)
    calibration.close()
    training.close()


def test_the_central_model_is_evaluated_with_statistics_recomputed_once_per_synchronisation():
    drawn = []

    def calibration(round, images):
        drawn.append((round, images))
        g = torch.Generator().manual_seed(round)
        for _ in range(-(-images // 4)):
            yield (torch.randint(0, 255, (4, 3, 16, 16), dtype=torch.uint8, generator=g),
                   torch.zeros(4, dtype=torch.int64))

    torch.manual_seed(0)
    sma = SMA(small_bn_model(), lambda array: None, 1, learners=2, alpha=None, momentum=0.9,
              central_momentum=None, weight_decay=0.0, calibration=calibration, calibration_images=12)
    before = sma.model[1].running_var.clone()
    sma.eval_model()
    sma.eval_model()                                   # z has not moved: nothing is recomputed
    assert drawn == [(0, 12)] and not torch.equal(before, sma.model[1].running_var)
    assert sma.learner_group.float_rows()[0].abs().sum() > 0      # the learners' own are untouched
    batch = [(torch.randint(0, 255, (4, 3, 16, 16), dtype=torch.uint8), torch.zeros(4, dtype=torch.int64))] * 2
    sma.step(batch, StepPlace(lr=0.05))
    sma.eval_model()
    assert drawn == [(0, 12), (1, 12)]
