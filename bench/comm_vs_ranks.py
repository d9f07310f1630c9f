"""FireCaffe figure 4 and equations 3-4: gradient communication time against the number of ranks.

``mpiexec -n P dimd bench-allreduce -a mpi,ps,tree,ring,multicolor`` at P = 2..5,
``runs`` times (interleaved), over four message sizes up to NiN's gradient
(30.4 MB for 1000 classes, FireCaffe's "30 MB per GPU worker"). The figure
is the time of one NiN-sized allreduce against P.

The cost model to P = 1024 is not fitted here: :func:`cost_model` hands these
bench-allreduce JSONs to ``dimd plan-batch comm`` (docs/plan-batch.md#step-2-communication),
the one place that fits FireCaffe's equations and the
Thakur-Rabenseifner-Gropp costs to measurements; its held-out errors go into
the result.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from _common import Context, JobError, Reproduction, dimd_job, spread

NIN_GRADIENT_BYTES = 30_380_704   # dimd.train.models: nin, 1000 classes, float32
FULL = {"ranks": [2, 3, 4, 5], "runs": 3, "algorithms": ["mpi", "ps", "tree", "ring", "multicolor"],
        "max_bytes": NIN_GRADIENT_BYTES, "factor": 4, "sizes": 4, "model_ranks_max": 1024}
QUICK = {"ranks": [2, 3], "max_bytes": NIN_GRADIENT_BYTES // 16, "sizes": 2}
BASELINE = "mpi"
#: FireCaffe's equations, as the scaling of time with P they predict (no fitted constant in a ratio).
EQUATIONS = {"ps": ("eq. 3: |W| P / BW", lambda p: p), "tree": ("eq. 4: |W| 2 log2 P / BW", lambda p: 2 * math.log2(p))}


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    p = ctx.size(FULL, QUICK)
    # a whole number of float32 elements (bench-allreduce labels each row with the bytes it reduces)
    min_bytes = p["max_bytes"] // p["factor"] ** (p["sizes"] - 1) // 4 * 4
    paths: list[Path] = []
    rows: dict[tuple[int, str, int], list[float]] = {}
    for run_ in range(p["runs"]):
        for ranks in p["ranks"]:
            ctx.log(f"run {run_ + 1}/{p['runs']}: bench-allreduce at P={ranks}")
            path = ctx.folder() / f"p{ranks}_run{run_}.json"
            doc = dimd_job(["bench-allreduce", "-a", ",".join(p["algorithms"]), "-b", min_bytes,
                            "-e", p["max_bytes"], "-f", p["factor"]], path, ranks=ranks)
            paths.append(path)
            for row in doc["result"]["rows"]:
                rows.setdefault((ranks, row["algorithm"], row["bytes"]), []).append(row["time_us"])
    measured = [{"ranks": ranks, "algorithm": algorithm, "bytes": nbytes, "time_us": spread(times)}
                for (ranks, algorithm, nbytes), times in sorted(rows.items())]
    nbytes = max(r["bytes"] for r in measured)
    return p, {"gradient_bytes": nbytes, "rows": measured,
               "cost_model": cost_model(ctx, paths, nbytes, p["model_ranks_max"])}


def cost_model(ctx: Context, paths: list[Path], nbytes: int, max_ranks: int) -> dict[str, Any]:
    """The cost model ``dimd plan-batch comm`` fits to these bench-allreduce JSONs.

    Its JSON (docs/plan-batch.md#step-2-communication) holds, per algorithm, the fitted
    parameters, the errors on held-out P, and ``predictions``: the time
    Delta(P) up to P = 1024. Nothing in bench/ fits a model of its own; when
    the fit fails the figure shows the measurements alone and says why.
    """
    try:
        doc = dimd_job(["plan-batch", "comm", *paths, "--bytes", nbytes, "--max-ranks", max_ranks],
                       ctx.folder() / "plan_batch_comm.json", command="plan-batch comm")
    except JobError as exc:
        ctx.log(f"dimd plan-batch comm failed: {exc}")
        return {"status": "failed", "why": str(exc).splitlines()[0]}
    return {"status": "fitted", "command": doc["command"], "fit": doc["result"]}


def draw_cost_model(ax: Any, model: dict[str, Any], nbytes: int) -> bool:
    """Draw the fitted Delta(P) curves to P = 1024; False when there is nothing to draw.

    Draws ``fit["algorithms"][name]["predictions"]`` (a list of ``{"ranks", "seconds"}``
    for the gradient size the fit was asked about), and nothing when the shape differs.
    """
    from dimd import plotting

    fits = model.get("fit", {}).get("algorithms") if model.get("status") == "fitted" else None
    if not isinstance(fits, dict):
        return False
    drawn = False
    for algorithm, fit in fits.items():
        points = fit.get("predictions") if isinstance(fit, dict) else None
        if not isinstance(points, list) or not all(isinstance(q, dict) and {"ranks", "seconds"} <= set(q)
                                                   for q in points):
            continue
        style = dict(plotting.BASELINE) if algorithm == BASELINE else {"color": plotting.color(algorithm)}
        style.update(linewidth=1.0, alpha=0.8, linestyle="-.")   # a model's curve, whatever the line's own style
        ax.plot([q["ranks"] for q in points], [q["seconds"] * 1e3 for q in points], **style)
        drawn = True
    return drawn


def plot(envelope: dict[str, Any]):
    from dimd import plotting

    result = envelope["result"]
    nbytes = result["gradient_bytes"]
    rows = [r for r in result["rows"] if r["bytes"] == nbytes]
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    fig, axes = plotting.figure(1, 2, width=5.4, height=4.2)
    for ax in axes[0]:
        for algorithm in algorithms:
            mine = sorted((r for r in rows if r["algorithm"] == algorithm), key=lambda r: r["ranks"])
            ranks = [r["ranks"] for r in mine]
            times = [plotting.scaled(r["time_us"], 1e-3) for r in mine]
            if algorithm == BASELINE:
                plotting.baseline(ax, ranks, times, "MPI_Allreduce (MPICH's default)")
            else:
                plotting.series(ax, ranks, times, {"ps": "parameter server (ps)", "tree": "reduction tree"}
                                .get(algorithm, algorithm), style={"color": plotting.color(algorithm)})
        ax.set_xlabel("ranks P")
        ax.set_ylabel(f"time of one {nbytes / 1e6:.1f} MB allreduce (ms)")
    zoom, wide = axes[0]
    zoom.set_title(f"measured (P = {min(r['ranks'] for r in rows)}-{max(r['ranks'] for r in rows)}, on 2 cores)")
    zoom.set_yscale("log")
    zoom.set_xticks(sorted({r["ranks"] for r in rows}))
    zoom.legend(fontsize=7)
    wide.set_xscale("log", base=2)
    wide.set_yscale("log")
    wide.set_xlim(1, envelope["parameters"].get("model_ranks_max", 1024) * 1.1)
    wide.set_xticks([2**k for k in range(0, 11)], [str(2**k) for k in range(0, 11)])
    if draw_cost_model(wide, result.get("cost_model", {}), nbytes):
        wide.set_title("fitted cost model (dash-dot) to P = 1024")
    else:
        wide.set_title("cost model to P = 1024: none")
        wide.text(0.5, 0.5, "`dimd plan-batch comm` fitted no model\n(see the findings)",
                  transform=wide.transAxes, ha="center", va="center", fontsize=8, color="#666666")
    return fig


def held_out(fit: dict[str, Any]) -> str:
    """``; median (max) error on held-out P = ...: ring 12% (39%), ...`` from a plan-batch comm result."""
    cells = [f"{name} {h['median_abs_error']:.0%} ({h['max_abs_error']:.0%})"
             for name, a in fit.get("algorithms", {}).items() if isinstance(h := a.get("holdout"), dict)]
    ranks = ", ".join(map(str, fit.get("holdout_ranks", [])))
    return f"; median (max) relative error on held-out P = {ranks}: " + ", ".join(cells) if cells else ""


def findings(envelope: dict[str, Any]) -> str:
    result, p = envelope["result"], envelope["parameters"]
    nbytes = result["gradient_bytes"]
    rows = [r for r in result["rows"] if r["bytes"] == nbytes]
    low, high = min(r["ranks"] for r in rows), max(r["ranks"] for r in rows)
    cells = []
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        mine = {r["ranks"]: r["time_us"]["median"] for r in rows if r["algorithm"] == algorithm}
        cell = (f"{algorithm} {mine[low] / 1e3:.1f} ms at P = {low}, {mine[high] / 1e3:.1f} ms at P = {high} "
                f"({mine[high] / mine[low]:.2f}x")
        if algorithm in EQUATIONS:
            name, scale = EQUATIONS[algorithm]
            cell += f"; FireCaffe's {name} predicts {scale(high) / scale(low):.2f}x"
        cells.append(cell + ")")
    model = result.get("cost_model", {})
    status = ("There is no cost model to P = 1024: " + model.get("why", "") + "." if model.get("status") != "fitted"
              else f"The cost model was fitted by `{model.get('command')}`" + held_out(model["fit"]) + ".")
    what = "NiN's gradient" if nbytes == NIN_GRADIENT_BYTES else f"1/{NIN_GRADIENT_BYTES // nbytes} of NiN's gradient"
    return (f"One {nbytes / 1e6:.1f} MB allreduce ({what}), medians of {p['runs']} runs: "
            + "; ".join(cells) + ". Here P > 2 ranks share the 2 cores, so a time at P > 2 holds waiting for a "
            "core as well as the communication the equations count. " + status)


REPRODUCTION = Reproduction(
    name="comm_vs_ranks",
    title="FireCaffe figure 4: communication time against the number of ranks",
    claim=("Summing NiN's 30 MB of gradients, a parameter server's communication time grows linearly with the "
           "number of workers (eq. 3: |W| p / BW) while a reduction tree's grows with log2 p (eq. 4: "
           "|W| 2 log2 p / BW); measured on up to 128 GPUs of the Titan supercomputer."),
    measure=measure, plot=plot, findings=findings, minutes=1.0)
