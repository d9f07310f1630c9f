"""The plan's figure: T_C against P for the three regimes, N_update against M with its fit,
Delta(P) per allreduce algorithm and Gamma(m) with its fit, in one PNG.

matplotlib is an optional extra, imported here only when a plot is asked for
(``plan-batch solve --plot``); a missing matplotlib is one clear error.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import numpy as np

from dimd.errors import DimdError
from dimd.train.plan.steptime import step_seconds

INSTALL_HINT = ("pip install --no-deps matplotlib contourpy cycler fonttools kiwisolver pyparsing "
                "python-dateutil six packaging")


def require_matplotlib() -> None:
    """Fail with one line, before any work, when matplotlib is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise DimdError(f"--plot needs matplotlib, an optional extra; install it without replacing "
                        f"pillow-simd: {INSTALL_HINT}")


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_plan(figures: dict[str, Any], step: dict[str, Any], comm: dict[str, Any], conv: dict[str, Any],
              path: str | Path) -> None:
    """Draw the four panels to ``path`` (PNG)."""
    from dimd.report import source_commit

    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    draw_time_to_target(axes[0][0], figures)
    draw_updates(axes[0][1], conv["result"], figures["model"])
    draw_communication(axes[1][0], comm["result"], figures)
    draw_step_time(axes[1][1], step["result"], figures["model"])
    model = figures["model"]
    fig.suptitle(f"plan-batch: T_C(M, P) = (N_inf + alpha/M) (c + gamma max(M/P, M_T) + Delta(P)); "
                 f"N_inf {model['n_inf']:.3g}, alpha {model['alpha']:.3g}, c {model['overhead']:.3g} s, "
                 f"gamma {model['gamma']:.3g} s, M_T {model['m_t']:.3g}", fontsize=10)
    inputs = "; ".join(f"{what} {doc.get('commit') or '?'} on {doc.get('host', '?')} {doc.get('date', '?')}"
                       for what, doc in (("step-time", step), ("comm", comm), ("convergence", conv)))
    fig.text(0.01, 0.005, f"plotted by dimd {source_commit() or '(not from a checkout)'} on {platform.node()}; "
                          f"inputs: {inputs}", fontsize=6.5, color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_time_to_target(ax, figures: dict[str, Any]) -> None:
    rows = figures["plan"]
    ranks = np.array([r["ranks"] for r in rows])
    for key, label, style in (("optimal", "optimal M(P)", "o-"),
                              ("strong", f"strong, M = {figures['strong_batch']}", "s--"),
                              ("weak", f"weak, M = {figures['weak_per_rank']} P", "^:")):
        times = np.array([r[key]["time_s"] if r[key]["time_s"] is not None else np.nan for r in rows])
        ax.plot(ranks, times, style, label=label, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("time to target T_C (s)")
    ax.set_title("time to target by scaling regime")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def draw_updates(ax, conv: dict[str, Any], model: dict[str, Any]) -> None:
    rows = conv.get("batches") or []
    used = [r for r in rows if r.get("median_updates") is not None]
    missed = [r for r in rows if r.get("median_updates") is None]
    if used:
        m = np.array([r["batch"] for r in used], dtype=float)
        med = np.array([r["median_updates"] for r in used], dtype=float)
        low = np.array([r["updates"]["min"] if r["updates"]["min"] is not None else v for r, v in zip(used, med)])
        high = np.array([r["updates"]["max"] if r["updates"]["max"] is not None else v for r, v in zip(used, med)])
        ax.errorbar(m, med, yerr=[med - low, high - med], fmt="o", capsize=3, label="median (min-max) of runs")
        grid = np.geomspace(m.min() / 1.5, m.max() * 1.5, 200)
        ax.plot(grid, model["n_inf"] + model["alpha"] / grid, "-",
                label=f"N_inf + alpha/M, R² {conv.get('r2', float('nan')):.3f}")
    for r in missed:
        ax.axvline(r["batch"], color="tab:red", alpha=0.4, linestyle=":")
    if missed:
        ax.plot([], [], ":", color="tab:red", label="median run missed the target")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch M")
    ax.set_ylabel("updates to target N_update")
    target = conv.get("target")
    ax.set_title("the inverse law" + (f" (target: {target})" if target is not None else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def draw_communication(ax, comm: dict[str, Any], figures: dict[str, Any]) -> None:
    left_out = figures.get("algorithms_left_out") or {}
    for name, fit in comm.get("algorithms", {}).items():
        points = [(p["ranks"], p["seconds"]) for p in fit["predictions"] if p["ranks"] > 1]
        if points:
            ranks, times = zip(*points)
            ax.plot(ranks, times, ":" if name in left_out else "-",
                    label=f"{name} (left out: failed its check)" if name in left_out else name,
                    linewidth=2 if name in ("ps", "tree") else 1)
    measured = comm.get("ranks_measured") or []
    if measured:
        ax.axvspan(min(measured), max(measured), color="0.85", alpha=0.6, label="measured P")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("one allreduce Delta(P) (s)")
    ax.set_title(f"allreduce of {figures['gradient_bytes'] / 2**20:.2f} MiB (fitted cost models)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def draw_step_time(ax, step: dict[str, Any], model: dict[str, Any]) -> None:
    rows = step.get("batches") or []
    if rows:
        m = np.array([r["batch"] for r in rows], dtype=float)
        med = np.array([r["seconds"]["median"] for r in rows])
        low = np.array([r["seconds"]["min"] for r in rows])
        high = np.array([r["seconds"]["max"] for r in rows])
        ax.errorbar(m, med, yerr=[med - low, high - med], fmt="o", capsize=3, label="median (min-max) step")
        grid = np.geomspace(m.min(), m.max(), 200)
        ax.plot(grid, step_seconds(model["overhead"], model["gamma"], model["m_t"], grid), "-",
                label="c + gamma max(m, M_T)")
        ax.axvline(model["m_t"], color="0.5", linestyle=":", label=f"M_T = {model['m_t']:.3g}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("images per rank m")
    ax.set_ylabel("compute per step Gamma(m) (s)")
    ax.set_title(f"step time ({step.get('world_size', '?')} rank(s), {step.get('threads', '?')} thread(s) each)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
