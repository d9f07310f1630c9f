"""bench/large_batch.py and bench/recipe.py: the held-out prediction, the time to the target, the aims."""

import pytest


def run(batch, seed, updates, optimizer="lars"):
    return {"batch": batch, "seed": seed, "updates": updates, "reached": updates is not None,
            "budget": None if updates is not None else 400, "reason": None if updates is not None else "budget",
            "optimizer": optimizer, "final_top1": 0.95, "train_seconds_to_target": 1.0}


def test_the_prediction_at_the_held_out_batch_comes_from_the_other_batches_only(bench):
    large = bench("large_batch")
    law = {32: 100 + 6400 / 32, 64: 100 + 6400 / 64, 256: 100 + 6400 / 256}
    runs = [run(m, s, round(n)) for m, n in law.items() for s in range(3)]
    runs += [run(128, s, 5000) for s in range(3)]          # far off the law: it must not move the fit
    prediction = large.held_out_prediction(runs, 128, 0.92)
    assert prediction["batches_in_fit"] == [32, 64, 256]
    assert prediction["predicted"] == pytest.approx(100 + 6400 / 128, rel=1e-3)


def test_a_batch_most_seeds_missed_has_no_median_and_the_aims_say_so(bench):
    large = bench("large_batch")
    batches = [32, 64, 128, 256]
    sgd = {"runs": [run(m, s, 300 if m < 128 else None, "sgd") for m in batches for s in range(5)], "target": 0.92}
    lars = {"runs": [run(m, s, 320 if m == 32 else 150) for m in batches for s in range(5)], "target": 0.92}
    figures = {"optimizers": {"sgd": large.compare(sgd, batches, 128, 5), "lars": large.compare(lars, batches, 128, 5)}}
    rows = {r["batch"]: r for r in figures["optimizers"]["sgd"]["rows"]}
    assert rows[128]["reached"] == 0 and rows[128]["median_updates"] is None and rows[128]["budget"] == 400
    aims = large.targets(figures)
    assert aims["lars_reaches_at_4x_every_seed"] == {"met": True, "reached": 5, "runs": 5, "sgd_reached": 0}
    assert aims["lars_within_10_percent_of_sgd_at_m_opt"]["ratio"] == pytest.approx(320 / 300)
    assert aims["lars_within_10_percent_of_sgd_at_m_opt"]["met"]


def epoch(n, top1, ema=None):
    entry = {"epoch": n, "val_top1": top1, "elapsed": 10.0 * n + 3, "train_seconds": 9.0}
    return {**entry, "ema_val_top1": ema} if ema is not None else entry


def test_the_time_to_the_target_is_the_first_epoch_at_it_counting_the_ema_where_better(bench):
    recipe = bench("recipe")
    history = [epoch(1, 0.5), epoch(2, 0.85, ema=0.9), epoch(3, 0.95)]
    assert recipe.to_target(history, 0.9) == {"seconds": 23.0, "train_seconds": 18.0, "epoch": 2}
    assert recipe.to_target(history[:1], 0.9) == {"seconds": None, "train_seconds": None, "epoch": None}


def test_progressive_resizing_is_judged_on_medians_against_the_plain_recipe(bench):
    recipe = bench("recipe")

    def setup(seconds, final):
        runs = [{"seconds_to_target": s, "train_seconds_to_target": s, "epoch_to_target": 5, "final_top1": f,
                 "seconds": 100.0} for s, f in zip(seconds, final)]
        return recipe.summary(runs)

    aims = recipe.targets({"plain": setup([100, 110, 120], [0.91, 0.92, 0.93]),
                           "progressive": setup([70, 80, 95], [0.905, 0.91, 0.92])})
    assert aims["progressive_time_at_most_0.8x"] == {"met": True, "ratio": pytest.approx(80 / 110)}
    assert aims["progressive_loses_at_most_1_point"] == {"met": True, "points_lost": pytest.approx(1.0)}
