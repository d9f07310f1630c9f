#!/usr/bin/env python3
"""The large-batch wall and LARS: SGD against LARS at M_opt, 2x, 4x and 8x M_opt on MNIST-5k (LeNet).

With plan_batch_check's recipe (SGD, the linear scaling rule, a one-epoch
warm-up, a constant rate after it), a batch of 4x M_opt often never reaches
the target: the scaled rate throws the model to chance top-1 and the run's
budget runs out. LARS (You, Gitman and Ginsburg, 2017) scales each layer's
rate by its trust ratio eta |w| / (|g| + wd |w|), which is what the
large-batch ImageNet runs use. Here, with the commands a user runs:

* M_opt: plan_batch_check's way, at this target: `plan-batch step-time`
  (P = 1), `bench-allreduce` + `plan-batch comm`, an SGD sweep
  (`plan-batch convergence`, 3 seeds a batch) and `plan-batch solve --ranks 1`;
* the comparison: `plan-batch convergence` at M_opt, 2x, 4x and 8x M_opt,
  once per optimizer, the same fresh seeds for both (5), every run to the
  target or its budget of epochs;
* the planner's prediction at 4x M_opt, per optimizer: the inverse law
  N_update = N_inf + alpha/M fitted by `plan-batch convergence`'s own fit
  (dimd.train.plan.convergence) to that optimizer's runs at the OTHER
  batches (M_opt, 2x, 8x), so the 4x runs it is checked against are not in it.

LARS's rate and trust coefficient (``OPTIMIZERS``) were chosen on one seed
(seed 0) at M = 51 and 204 before the comparison; what was tried is in
``LARS_TRIED`` and in the JSON. Updates to the target do not depend on the
machine's load; seconds are recorded but not compared.

    .venv/bin/python bench/reproduce.py large_batch          # ~10 min on a quiet 2-core machine
    .venv/bin/python bench/reproduce.py large_batch --quick  # a smoke test: lower target, 1 seed
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import plan_batch_check as check
from _common import Context, Reproduction, spread

NAME = "large_batch"
#: Batches of the comparison, as multiples of M_opt; the planner's prediction is checked at HELD_OUT.
MULTIPLES = (1, 2, 4, 8)
HELD_OUT = 4
#: Each optimizer's base rate (for 256 images, scaled linearly as dimd train's) and LARS's trust coefficient.
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": check.SETS["mnist"]["lr"]},
    "lars": {"lr": 2.0, "trust": 0.01},
}
#: LARS's (lr, trust) tried on seed 0 at M = 51 and 204 (target 92%, budget 20 epochs) before choosing
#: OPTIMIZERS["lars"]: updates to the target, None where the run missed (2026-11-29, this machine).
LARS_TRIED: list[dict[str, Any]] = [
    {"optimizer": "sgd", "lr": 0.1, "updates": {"51": 412, "204": None}},   # the baseline; 204 ended at chance
    {"optimizer": "lars", "lr": 2.0, "trust": 0.001, "updates": {"51": None, "204": None}},   # too slow
    {"optimizer": "lars", "lr": 5.0, "trust": 0.001, "updates": {"51": 1157, "204": 277}},
    {"optimizer": "lars", "lr": 10.0, "trust": 0.001, "updates": {"51": 706, "204": 273}},
    {"optimizer": "lars", "lr": 1.0, "trust": 0.01, "updates": {"51": 775, "204": 179}},
    {"optimizer": "lars", "lr": 2.0, "trust": 0.01, "updates": {"51": 451, "204": 157}},   # chosen
    {"optimizer": "lars", "lr": 4.0, "trust": 0.01, "updates": {"51": 442, "204": None}},  # 204 ended at chance
]
FULL: dict[str, Any] = {"target": 0.92, "sweep_batches": (8, 16, 32, 64, 128, 256), "sweep_seeds": 3, "seeds": 5,
                        "max_epochs": 20, "eval_every": 500, "first_seed": check.CHECK_SEED,
                        "threads": check.THREADS_PER_RANK}
QUICK: dict[str, Any] = {"target": 0.8, "sweep_batches": (8, 32, 128), "sweep_seeds": 1, "seeds": 1,
                         "max_epochs": 6, "eval_every": 1000}


def optimizer_args(name: str) -> tuple[Any, ...]:
    """`plan-batch convergence`'s options for ``name`` (its --lr after the recipe's, so it is the one used)."""
    o = OPTIMIZERS[name]
    trust = ("--lars-trust", o["trust"]) if "trust" in o else ()
    return ("--optimizer", name, "--lr", o["lr"], *trust)


def m_opt(data: tuple[Path, Path], p: dict[str, Any], work: Path, quick: bool, ctx: Context) -> dict[str, Any]:
    """The planner's M_opt at P = 1 for SGD at this target: step time, comm, the SGD sweep and solve."""
    step, comm = work / "step_P1.json", work / "comm.json"
    ctx.log("plan-batch step-time at P = 1")
    check.run(check.DIMD + check.step_time_args(data, quick) + ["--json", step], log=step.with_suffix(".log"))
    bench = []
    for ranks in check.BENCH_RANKS:
        bench.append(work / f"ar_P{ranks}.json")
        check.run(check.mpi(ranks) + check.DIMD + ["bench-allreduce", "-a", "ring,tree", "-b", "16K", "-e", "1M",
                                                   "-f", 4, "--model", "lenet", "--json", bench[-1]],
                  log=bench[-1].with_suffix(".log"))
    check.run(check.DIMD + ["plan-batch", "comm", *bench, "--json", comm], log=comm.with_suffix(".log"))
    ctx.log("plan-batch convergence: the SGD sweep")
    sweep_path = work / "sgd_sweep.json"
    sweep = check.convergence("mnist", data, size(p, p["sweep_batches"], p["sweep_seeds"]), sweep_path,
                              extra=optimizer_args("sgd"))
    plan_path = work / "plan_P1.json"
    check.run(check.DIMD + ["plan-batch", "solve", "--step", step, "--comm", comm, "--convergence", sweep_path,
                            "--ranks", 1, "--max-batch", max(p["sweep_batches"]), "--max-holdout-error", 1000,
                            "--json", plan_path], log=plan_path.with_suffix(".log"))
    row = check.result(plan_path)["plan"][0]
    return {"batch": row["optimal"]["batch"], "case": row["optimal"]["case"],
            "sweep": check.summary(sweep), "files": {"sweep": str(sweep_path), "plan": str(plan_path)}}


def size(p: dict[str, Any], batches: tuple[int, ...], seeds: int) -> dict[str, Any]:
    """plan_batch_check.convergence's size: the target, the budget, the evaluation interval, the batches."""
    return {"target": p["target"], "batches": batches, "seeds": seeds, "max_epochs": p["max_epochs"],
            "eval_every": p["eval_every"]}


def held_out_prediction(runs: list[dict[str, Any]], held_out: int, target: float) -> dict[str, Any]:
    """plan-batch convergence's fit of N_inf + alpha/M to the runs at every batch but ``held_out``, and what it
    predicts there: the check is not circular, the held-out runs are not in the fit."""
    from dimd.train.plan.convergence import Run, convergence_figures

    kept = [Run(r["batch"], r["seed"], r["updates"], r.get("budget"), r.get("reason"), r.get("optimizer", "sgd"))
            for r in runs if r["batch"] != held_out]
    try:
        fit = convergence_figures(kept, target)
    except Exception as exc:   # e.g. fewer than 2 batches reached the target: no prediction, said why
        return {"n_inf": None, "alpha": None, "r2": None, "batches_in_fit": [], "predicted": None, "error": str(exc)}
    return {"n_inf": fit["n_inf"], "alpha": fit["alpha"], "r2": fit["r2"],
            "batches_in_fit": [row["batch"] for row in fit["batches"] if row["in_fit"]],
            "predicted": fit["n_inf"] + fit["alpha"] / held_out, "error": None}


def compare(conv: dict[str, Any], batches: list[int], held_out: int, seeds: int) -> dict[str, Any]:
    """One optimizer's rows (updates per seed, missed runs, the median counting a miss as beyond the budget) and
    the prediction at ``held_out`` against its median."""
    rows = []
    for multiple, batch in zip(MULTIPLES, batches):
        runs = sorted((r for r in conv["runs"] if r["batch"] == batch), key=lambda r: r["seed"])
        hit = [r["updates"] for r in runs if r["reached"]]
        rows.append({"multiple": multiple, "batch": batch, "runs": len(runs), "reached": len(hit),
                     "updates_per_seed": {str(r["seed"]): r["updates"] for r in runs},
                     "updates": spread(hit),
                     # a missed run counts as beyond its budget: the median exists while most runs reached
                     "median_updates": statistics.median(hit + [float("inf")] * (len(runs) - len(hit)))
                     if len(hit) * 2 > len(runs) else None,
                     "budget": max((r["budget"] or 0 for r in runs if not r["reached"]), default=None),
                     "final_top1_missed": [r["final_top1"] for r in runs if not r["reached"]],
                     "train_seconds": spread([r["train_seconds_to_target"] for r in runs if r["reached"]])})
    prediction = held_out_prediction(conv["runs"], held_out, conv["target"])
    measured = next(r["median_updates"] for r in rows if r["batch"] == held_out)
    prediction["measured"] = measured
    prediction["relative_error"] = ((prediction["predicted"] - measured) / measured
                                    if prediction["predicted"] is not None and measured else None)
    return {"rows": rows, "prediction": prediction, "lr": conv.get("lr"), "seeds": seeds}


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    p = ctx.size(FULL, QUICK)
    p["optimizers"], p["lars_tried"] = OPTIMIZERS, LARS_TRIED
    p["recipe"] = {k: v for k, v in check.SETS["mnist"].items() if k not in ("full", "quick")}
    work = ctx.folder("quick" if ctx.quick else "full")
    data = check.prepare("mnist", ctx.work)
    optimum = m_opt(data, p, work, ctx.quick, ctx)
    ctx.log(f"M_opt = {optimum['batch']}: SGD and LARS at {', '.join(f'{k}x' for k in MULTIPLES)}")
    batches = [k * optimum["batch"] for k in MULTIPLES]
    held_out = HELD_OUT * optimum["batch"]
    figures: dict[str, Any] = {"m_opt": optimum, "batches": batches, "held_out": held_out, "optimizers": {}}
    for name in OPTIMIZERS:   # side by side: the same batches, seeds, budget and evaluations
        out = work / f"{name}.json"
        conv = check.convergence("mnist", data, size(p, tuple(batches), p["seeds"]), out, seeds=p["seeds"],
                                 first_seed=p["first_seed"], extra=optimizer_args(name))
        figures["optimizers"][name] = {**compare(conv, batches, held_out, p["seeds"]), "file": str(out)}
    figures["targets"] = targets(figures)
    return p, figures


def targets(figures: dict[str, Any]) -> dict[str, Any]:
    """The aims, each with the figures it rests on."""
    sgd, lars = (figures["optimizers"][k] for k in ("sgd", "lars"))
    at = {name: {r["multiple"]: r for r in o["rows"]} for name, o in (("sgd", sgd), ("lars", lars))}
    lars_4x, sgd_1x, lars_1x = at["lars"][HELD_OUT], at["sgd"][1]["median_updates"], at["lars"][1]["median_updates"]
    ratio = lars_1x / sgd_1x if lars_1x and sgd_1x else None
    error = lars["prediction"]["relative_error"]
    return {
        "lars_reaches_at_4x_every_seed": {"met": lars_4x["reached"] == lars_4x["runs"], "reached": lars_4x["reached"],
                                          "runs": lars_4x["runs"], "sgd_reached": at["sgd"][HELD_OUT]["reached"]},
        "lars_within_10_percent_of_sgd_at_m_opt": {"met": ratio is not None and ratio <= 1.1, "ratio": ratio},
        "prediction_within_25_percent_at_4x": {"met": error is not None and abs(error) <= 0.25,
                                               "relative_error": error},
    }


# -- the figure and what it shows ------------------------------------------------------------------

COLOURS = {"sgd": "#1f77b4", "lars": "#d62728"}


def plot(envelope: dict[str, Any]) -> Any:
    import numpy as np
    from dimd import plotting
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    f = envelope["result"]
    fig, axes = plotting.figure(1, 2, width=5.6, height=4.2)
    ax, reach = axes[0]
    for i, (name, o) in enumerate(f["optimizers"].items()):
        colour = COLOURS.get(name, plotting.color(name, i))
        shift = 1.0 + 0.04 * (i - 0.5)   # the two optimizers' dots side by side at each batch
        for row in o["rows"]:
            hit = [u for u in row["updates_per_seed"].values() if u is not None]
            ax.scatter([row["batch"] * shift] * len(hit), hit, color=colour, alpha=0.35, s=14)
            missed = row["runs"] - row["reached"]
            if missed:
                ax.scatter([row["batch"] * shift], [row["budget"]], color=colour, marker="x", s=45)
        medians = [(r["batch"], r["median_updates"]) for r in o["rows"] if r["median_updates"] is not None]
        ax.plot([m for m, _ in medians], [u for _, u in medians], color=colour, marker="o",
                label=f"{name.upper()} (lr {OPTIMIZERS.get(name, {}).get('lr', '?')}): median of the runs")
        pred = o["prediction"]
        if pred["predicted"] is not None:
            m = np.geomspace(min(f["batches"]), max(f["batches"]), 100)
            ax.plot(m, pred["n_inf"] + pred["alpha"] / m, color=colour, linestyle="--", linewidth=1,
                    label=f"{name.upper()}: planner's law fitted without {HELD_OUT}x M_opt")
            ax.scatter([f["held_out"]], [pred["predicted"]], marker="*", s=140, color=colour, edgecolors="black",
                       zorder=5, label=f"{name.upper()}: predicted at {HELD_OUT}x M_opt"
                       + (f" ({100 * pred['relative_error']:+.0f}%)" if pred["relative_error"] is not None else ""))
        reach.bar([j + 0.2 * (2 * i - 1) for j in range(len(o["rows"]))], [r["reached"] for r in o["rows"]],
                  width=0.4, color=colour, label=name.upper())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(f["batches"], [f"{b}\n({k}x)" for b, k in zip(f["batches"], MULTIPLES)])
    ax.minorticks_off()
    low, high = ax.get_ylim()   # a log axis within one decade gets no labels of its own: round numbers
    ax.set_yticks([t for t in (20, 30, 50, 70, 100, 150, 200, 300, 500, 700, 1000, 1500, 2000, 3000, 5000)
                   if low <= t <= high], minor=False)
    ax.yaxis.set_major_formatter(ScalarFormatter())
    target = envelope["parameters"]["target"]
    ax.set_xlabel("global batch M (images; multiple of M_opt)")
    ax.set_ylabel(f"updates to {100 * target:g}% top-1")
    ax.set_title("updates to the target (dots: seeds; x: missed, at the budget)")
    ax.legend(fontsize=7)
    rows = next(iter(f["optimizers"].values()))["rows"]
    reach.set_xticks(range(len(rows)), [f"M = {r['batch']}\n({r['multiple']}x)" for r in rows])
    reach.set_ylim(0, max(r["runs"] for r in rows) + 0.5)
    reach.yaxis.set_major_locator(MaxNLocator(integer=True))
    reach.set_ylabel("seeds that reached the target")
    reach.set_xlabel("global batch")
    reach.set_title(f"seeds reaching {100 * target:g}% within the budget")
    reach.legend(fontsize=8)
    return fig


def findings(envelope: dict[str, Any]) -> str:
    f, p = envelope["result"], envelope["parameters"]
    t = f["targets"]
    parts = [f"M_opt = {f['m_opt']['batch']} (the planner at P = 1, from the SGD sweep at {100 * p['target']:g}% "
             f"top-1); {p['seeds']} seeds per batch, a budget of {p['max_epochs']} epochs."]
    for name, o in f["optimizers"].items():
        cells = []
        for r in o["rows"]:
            median = f"median {r['median_updates']:.0f} updates" if r["median_updates"] is not None else "no median"
            missed = r["final_top1_missed"]
            ended = (f" (the missed runs' last top-1: {', '.join(f'{100 * t:.0f}%' for t in missed)})"
                     if missed else "")
            cells.append(f"{r['multiple']}x (M = {r['batch']}): {r['reached']}/{r['runs']} reached, {median}{ended}")
        parts.append(f"{name.upper()} (lr {OPTIMIZERS.get(name, {}).get('lr', '?')} per 256 images"
                     + (f", trust {OPTIMIZERS[name]['trust']}" if "trust" in OPTIMIZERS.get(name, {}) else "")
                     + "): " + "; ".join(cells) + ".")
    reach, ratio = t["lars_reaches_at_4x_every_seed"], t["lars_within_10_percent_of_sgd_at_m_opt"]
    parts.append(f"At {HELD_OUT}x M_opt LARS reached the target in {reach['reached']} of {reach['runs']} seeds, "
                 f"SGD in {reach['sgd_reached']} (aim: every seed: {'met' if reach['met'] else 'missed'}).")
    parts.append(f"At M_opt LARS took {ratio['ratio']:.2f}x SGD's median updates (aim: at most 1.10: "
                 f"{'met' if ratio['met'] else 'missed'})." if ratio["ratio"] is not None
                 else "At M_opt one optimizer has no median (most seeds missed).")
    for name, o in f["optimizers"].items():
        pred = o["prediction"]
        if pred["predicted"] is None:
            parts.append(f"{name.upper()}: no prediction at {HELD_OUT}x ({pred['error']}).")
            continue
        against = (f"against a measured median of {pred['measured']:.0f} ({100 * pred['relative_error']:+.0f}%)"
                   if pred["relative_error"] is not None else "where most seeds missed")
        fitted = ", ".join(map(str, pred["batches_in_fit"]))
        parts.append(f"{name.upper()}: the inverse law fitted to the runs at M = {fitted} only "
                     f"({pred['n_inf']:.3g} + {pred['alpha']:.3g}/M) "
                     f"predicts {pred['predicted']:.0f} updates at M = {f['held_out']}, {against}.")
    for name, o in f["optimizers"].items():   # a batch every seed missed: did the budget even allow the law's updates?
        pred = o["prediction"]
        for r in o["rows"]:
            if r["reached"] == 0 and r["budget"] and pred["predicted"] is not None:
                asks = pred["n_inf"] + pred["alpha"] / r["batch"]
                short = ": more than the budget, so a median run could not reach the target within it"
                parts.append(f"{name.upper()} at M = {r['batch']}: the budget allowed {r['budget']} updates, the "
                             f"fitted law asks {asks:.0f}" + (short if asks > r["budget"] else "") + ".")
    error = t["prediction_within_25_percent_at_4x"]
    parts.append(f"LARS's prediction aim (within 25%): {'met' if error['met'] else 'missed'}.")
    return " ".join(parts)


REPRODUCTION = Reproduction(
    name=NAME,
    title="You et al.: LARS past the large-batch wall, SGD against LARS at 1-8x M_opt",
    claim=("You, Gitman and Ginsburg (2017) train at batches where SGD with the linear scaling rule and warm-up "
           "diverges or stalls by scaling each layer's rate by its trust ratio eta |w| / (|g| + wd |w|) (LARS), "
           "and MLPerf's large-batch ResNet-50 runs use it. Here, on MNIST-5k with LeNet, SGD and LARS train to "
           "92% top-1 at the planner's M_opt and 2x, 4x, 8x it, 5 seeds each (aims: LARS reaches the target at "
           "4x M_opt in every seed; at M_opt it needs at most 10% more updates than SGD), and the planner's inverse "
           "law, fitted per optimizer to the other batches, predicts the 4x runs' updates (aim: within 25%)."),
    measure=measure, plot=plot, findings=findings, minutes=10.0)


if __name__ == "__main__":   # standalone: the runner, for this reproduction alone
    import reproduce

    sys.exit(reproduce.main([NAME, *sys.argv[1:]]))
