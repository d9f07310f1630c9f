"""N_update(M) = N_inf + alpha/M from runs to a target, missed runs reported and never dropped."""

import numpy as np
import pytest

from dimd.errors import DimdError
from dimd.train.plan.convergence import (COMMAND, Run, convergence_document, convergence_figures,
                                         first_reached, fit_inverse_law, synthetic_runs, updates_to_target)

BATCHES = [8, 16, 32, 64, 128, 256, 512]


def test_exact_inverse_law_is_recovered_with_r2_one():
    fit = fit_inverse_law(BATCHES, updates_to_target(300.0, 64000.0, np.array(BATCHES)))
    assert fit.n_inf == pytest.approx(300.0) and fit.alpha == pytest.approx(64000.0)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.critical_batch == pytest.approx(64000 / 300)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_runs_recover_n_inf_and_alpha(seed):
    runs = synthetic_runs(300.0, 64000.0, BATCHES, seeds=5, noise=0.05, rng=seed)
    figures = convergence_figures(runs, target="top-1 0.9")
    assert figures["n_inf"] == pytest.approx(300.0, rel=0.1)
    assert figures["alpha"] == pytest.approx(64000.0, rel=0.05)
    assert figures["r2"] > 0.99
    row = figures["batches"][0]
    assert row["batch"] == 8 and row["runs"] == 5 and row["reached"] == 5 and row["unreached"] == 0
    assert row["updates"]["min"] <= row["median_updates"] <= row["updates"]["max"]
    assert len(row["updates"]["runs"]) == 5


def test_unreached_runs_are_reported_and_counted_in_the_median():
    runs = [Run(16, s, u) for s, u in enumerate([4300, 4400, 4500])]
    runs += [Run(64, 0, 1300), Run(64, 1, 1350), Run(64, 2, None, budget=2000)]   # one missed: median of 3
    runs += [Run(256, 0, 500), Run(256, 1, None, budget=800), Run(256, 2, None, budget=800)]   # median missed
    figures = convergence_figures(runs)
    by_batch = {row["batch"]: row for row in figures["batches"]}
    assert by_batch[64]["unreached"] == 1 and by_batch[64]["median_updates"] == 1350
    assert by_batch[64]["unreached_runs"] == [{"seed": 2, "budget": 2000, "reason": None}]
    assert by_batch[64]["in_fit"]
    assert by_batch[256]["median_updates"] is None and not by_batch[256]["in_fit"]
    assert by_batch[256]["reached"] == 1 and by_batch[256]["updates"]["runs"] == [500.0]
    assert figures["unreached_runs"] == 3
    assert figures["n_inf"] + figures["alpha"] / 16 == pytest.approx(4400, rel=0.01)


def test_a_target_never_reached_is_one_clear_error():
    runs = [Run(b, s, None, budget=1000) for b in (16, 64) for s in range(2)]
    with pytest.raises(DimdError, match=r"no run reached the target top-1 0\.99 \(4 runs at batches 16, 64\)"):
        convergence_figures(runs, target="top-1 0.99")


def test_a_single_batch_that_reached_cannot_fit_the_law():
    runs = [Run(16, 0, 4000), Run(16, 1, 4100), Run(64, 0, None, budget=2000)]
    with pytest.raises(DimdError, match=r"only 1 batch size\(s\) reached .* M=16: 2/2, M=64: 0/1"):
        convergence_figures(runs)


def test_the_document_is_the_envelope_solve_reads():
    doc = convergence_document(synthetic_runs(100.0, 5000.0, [8, 32, 128], seeds=2, rng=3),
                               {"model": "lenet", "target_top1": 0.9}, target=0.9)
    assert doc["command"] == COMMAND == "plan-batch convergence"
    assert doc["parameters"]["model"] == "lenet"
    assert {"n_inf", "alpha", "r2", "batches"} <= set(doc["result"])


def test_synthetic_runs_over_budget_are_unreached():
    runs = synthetic_runs(100.0, 5000.0, [1, 1000], seeds=3, noise=0.0, budget=1000)
    assert [r.updates for r in runs if r.batch == 1] == [None, None, None]
    assert all(r.budget == 1000 for r in runs if r.batch == 1)
    assert [r.updates for r in runs if r.batch == 1000] == [105, 105, 105]


def test_first_reached_reads_evaluations_in_training_order():
    evaluations = [(100, 0.41), (200, 0.87), (300, 0.90), (400, 0.88), (500, 0.93)]
    assert first_reached(evaluations, 0.9) == 300
    assert first_reached(evaluations, 0.95) is None
    assert first_reached([], 0.5) is None


def test_standard_errors_match_the_scatter_of_repeated_sweeps():
    """Over many noisy sweeps of the same law (5 % relative noise), the fitted N_inf scatters as its
    standard error says."""
    import numpy as np

    from dimd.train.plan.convergence import fit_inverse_law

    rng = np.random.default_rng(8)
    batches = np.array([8, 16, 32, 64, 128, 256])
    law = 100 + 16000 / batches
    fits = [fit_inverse_law(batches, law * (1 + rng.normal(0, 0.05, batches.size))) for _ in range(2000)]
    n_inf = np.array([f.n_inf for f in fits])
    assert abs(n_inf.mean() - 100) < 4 * n_inf.std() / np.sqrt(n_inf.size)
    # the typical standard error estimates the scatter (within 10 %)
    assert np.median([f.n_inf_se for f in fits]) == pytest.approx(n_inf.std(), rel=0.1)
    assert np.median([f.alpha_se for f in fits]) == pytest.approx(np.std([f.alpha for f in fits]), rel=0.1)


def test_two_batches_give_no_standard_errors_and_a_range_says_how_well_b_crit_is_known():
    from dimd.train.plan.convergence import fit_inverse_law

    assert fit_inverse_law([16, 64], [100, 48]).n_inf_se is None
    assert fit_inverse_law([16, 64], [100, 48]).critical_batch_range is None
    pinned = fit_inverse_law([8, 32, 128, 512], [2120, 590, 230, 128])      # the law bends: N_inf is clear
    low, high = pinned.critical_batch_range
    assert low < pinned.critical_batch < high
    flat = fit_inverse_law([8, 32, 128], [1010, 245, 64])                      # all far below B_crit
    assert flat.critical_batch_range[1] is None                               # N_inf may be 0: no upper end


def test_a_fit_names_the_optimizer_of_its_runs_and_refuses_runs_of_two():
    lars = synthetic_runs(50.0, 8000.0, [16, 64, 256], seeds=2, rng=1, optimizer="lars")
    assert convergence_figures(lars)["optimizer"] == "lars"
    assert convergence_figures(synthetic_runs(50.0, 8000.0, [16, 64], seeds=1))["optimizer"] == "sgd"
    mixed = lars + synthetic_runs(50.0, 8000.0, [16, 64], seeds=1, rng=2)
    with pytest.raises(DimdError, match=r"^the runs were trained by lars, sgd: one inverse law fits one "
                                        r"optimizer's runs; fit each optimizer's runs apart$"):
        convergence_figures(mixed)
