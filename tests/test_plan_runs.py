"""plan-batch convergence's runs through the real engine, scored by a validation "accuracy" that follows a known law.

The training is real (packed data, loader, S-SGD steps, the engine's
evaluation schedule, its stop at the target and at the end of the budget);
only the evaluation's score is replaced, by 1 once a run has taken
N_inf + alpha / M steps and 0 before, so the updates each run must report
are known exactly.
"""

import pytest
from test_plan_cli import score_by_law


def config(data, **changes):
    from dimd.train.plan.config import ConvergenceConfig

    settings = dict(train=str(data), val=str(data), model="lenet", target_top1=0.5, batch_sizes=(4, 8, 48),
                    seeds=2, max_epochs=2, eval_every_images=8, image_size=16, threads=1, decode_workers=1,
                    lr=0.1)
    return ConvergenceConfig(**{**settings, **changes})


def test_updates_to_target_and_a_run_out_of_budget(packed_sample, world, monkeypatch):
    from dimd.train.engine import Trainer
    from dimd.train.plan.convergence import convergence_figures
    from dimd.train.plan.runs import run_convergence

    monkeypatch.setattr(Trainer, "evaluate", score_by_law(3, 32, samples=48))
    swept = run_convergence(config(packed_sample), world)
    updates = {(r.batch, r.seed): r.updates for r in swept.records}
    # N = 3 + 32/M: 11 at M = 4 (evaluated every 2 steps: first at step 12), 7 at M = 8 (every step),
    # 3.7 at M = 48, which has 1 step an epoch and 2 in its budget: never reached
    assert updates == {(4, 0): 12, (4, 1): 12, (8, 0): 7, (8, 1): 7, (48, 0): None, (48, 1): None}
    missed = [r for r in swept.records if not r.reached]
    assert [(r.reason, r.budget, r.steps) for r in missed] == [("budget", 2, 2)] * 2
    assert [e[0] for e in missed[0].evaluations] == [1, 2]     # evaluated at both epoch ends, never reached
    assert swept.groups == 1 and swept.eval_every_images == 8 and swept.training_images == 48

    figures = convergence_figures(swept.runs(), 0.5)
    rows = {row["batch"]: row for row in figures["batches"]}
    assert rows[48]["unreached_runs"] == [{"seed": 0, "budget": 2, "reason": "budget"},
                                          {"seed": 1, "budget": 2, "reason": "budget"}]
    assert not rows[48]["in_fit"] and figures["unreached_runs"] == 2
    # two medians, (1/4, 12) and (1/8, 7): the line through them
    assert figures["alpha"] == pytest.approx(40) and figures["n_inf"] == pytest.approx(2) and figures["r2"] == 1


def test_a_diverging_run_is_reported_not_fatal(packed_sample, world, monkeypatch):
    from dimd.train.engine import Trainer
    from dimd.train.plan.runs import run_convergence
    from dimd.train.sgd import SSGD

    real_step = SSGD.step

    def step(self, batches, lr, **kwargs):   # at M = 24 the second update stops being finite
        result = real_step(self, batches, lr, **kwargs)
        if len(batches[0][1]) == 24:
            self.updates = getattr(self, "updates", 0) + 1   # one strategy object per run
            result.finite = self.updates < 2
        return result

    monkeypatch.setattr(Trainer, "evaluate", score_by_law(1, 8, samples=48))
    monkeypatch.setattr(SSGD, "step", step)
    swept = run_convergence(config(packed_sample, batch_sizes=(4, 24), seeds=1, eval_every_images=100), world)
    by_batch = {r.batch: r for r in swept.records}
    assert by_batch[4].reached and by_batch[4].updates == 12    # N = 3 at M = 4; evaluated at the epoch end
    assert not by_batch[24].reached and by_batch[24].reason == "diverged at step 2"


def test_the_runs_are_handed_out_largest_batch_first(packed_sample):
    from dimd.train.plan.runs import run_order

    order = run_order(config(packed_sample, batch_sizes=(8, 48, 4), seeds=2, first_seed=5))
    assert [(r.batch, r.seed) for r in order] == [(48, 5), (48, 6), (8, 5), (8, 6), (4, 5), (4, 6)]


def test_the_run_config_is_dimd_trains_with_linear_scaling(packed_sample):
    from dimd.train.config import TrainConfig

    c = config(packed_sample, ranks_per_run=2, batch_sizes=(8, 32), warmup_epochs=0.5)
    run = c.train_config(32, seed=7, threads=3)
    assert isinstance(run, TrainConfig)
    assert (run.batch_size, run.seed, run.threads, run.lr, run.lr_scaling, run.schedule) == (16, 7, 3, 0.1, True,
                                                                                          "constant")
    assert run.warmup_epochs == 0.5 and run.momentum == TrainConfig.momentum and run.epochs == 2
    assert run.eval_batch_size == 128 and run.image_size == 16 and run.crop_scale == TrainConfig.crop_scale
