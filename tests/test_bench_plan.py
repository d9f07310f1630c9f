"""bench/plan_batch_check.py's arithmetic: which batches it checks, what it predicts, how it reads B_simple."""


import pytest

@pytest.fixture
def check(bench):
    return bench("plan_batch_check")


def test_the_other_batches_straddle_m_opt_by_a_factor_4_where_the_sweep_allows(check):
    assert check.other_batches(32, 1, 8, 256) == [8, 128]
    assert check.other_batches(8, 1, 8, 256) == [32, 128]        # nothing swept below: both above
    assert check.other_batches(256, 2, 4, 256) == [64, 16]       # nothing above: both below
    assert check.other_batches(12, 2, 4, 256) == [6, 48]         # 12/4 = 3 is below the sweep (and odd): /2
    assert all(m % 2 == 0 for m in check.other_batches(40, 2, 4, 256))


def test_the_prediction_charges_the_slowest_ranks_share(check):
    model = {"overhead": 0.0005, "gamma": 0.001, "m_t": 4.0, "n_inf": 100.0, "alpha": 6400.0}
    row = {"delta_s": 0.002}
    p = check.predicted(row, model, 33, 2)          # 17 images on the slowest rank
    assert p["updates"] == pytest.approx(100 + 6400 / 33)
    assert p["update_s"] == pytest.approx(0.0175 + 0.002) and p["gamma_s"] == pytest.approx(0.0175)
    assert p["time_s"] == pytest.approx(p["updates"] * p["update_s"])
    assert check.predicted(row, model, 4, 2)["gamma_s"] == pytest.approx(0.0045)   # below the knee: flat


def noise(values):
    return {"global_batch": 64, "epochs": len(values),
            "per_epoch": [{"epoch": i + 1, "noise_scale": v} for i, v in enumerate(values)]}


def test_b_simple_is_set_against_alpha_over_n_inf_and_says_when_that_is_not_known(check):
    pinned = {"n_inf": 80.0, "n_inf_se": 10.0, "b_crit": 200.0, "b_crit_range": [177.8, 228.6]}
    out = check.noise_against_fit(noise([None, 150.0, 90.0, 110.0]), pinned)
    assert out["b_simple"] == 110.0 and out["ratio"] == pytest.approx(0.55)
    assert out["within_factor_2"] and out["b_crit_determined"] and out["why_not_determined"] is None
    loose = {"n_inf": 0.2, "n_inf_se": 30.0, "b_crit": 40000.0, "b_crit_range": [265.0, None]}
    out = check.noise_against_fit(noise([86.0, 73.0]), loose)
    assert not out["within_factor_2"] and not out["b_crit_determined"]
    assert "may be 0" in out["why_not_determined"] and "sweep larger batches" in out["why_not_determined"]
    assert check.noise_against_fit(noise([None, None]), pinned)["b_simple"] is None


def test_runs_that_sit_at_chance_after_the_warm_up_explain_a_b_simple_far_from_alpha_over_n_inf(check):
    def run(batch, tops):
        return {"batch": batch, "steps_per_epoch": 2, "evaluations": [[i + 1, t, 0.0] for i, t in enumerate(tops)]}

    conv = {"classes": 10, "runs": [run(16, [0.1, 0.3, 0.5, 0.6]), run(128, [0.2, 0.1, 0.11, 0.5, 0.6, 0.1])]}
    assert check.at_chance(conv) == {"16": 0.0, "128": 0.5}      # after step 2, at 128: 0.11 and 0.1 of 4
    conv.update({"n_inf": 90.0, "n_inf_se": 10.0, "b_crit": 22.0, "b_crit_range": [20.0, 24.0]})
    out = check.noise_against_fit(noise([150.0, 140.0]), conv)
    assert not out["within_factor_2"]
    assert "at M = 128 the linearly scaled rate destabilised" in out["why_not_determined"]
