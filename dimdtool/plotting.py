"""The common look of dimd's figures (bench/'s, ``dimd plot``'s): units on every axis, log scales where sizes
span decades, the baseline drawn the same way everywhere, and the machine and commit in a footnote.

matplotlib is an optional extra (``make plots-setup``), imported only by what draws; it writes PNGs through
Pillow, which here must be pillow-simd (:func:`check_pillow_simd` refuses a plain Pillow).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

#: One colour per allreduce algorithm (and peer), the same in every figure.
COLORS = {
    "multicolor": "#d62728", "ring": "#1f77b4", "ring-root": "#17becf", "tree": "#2ca02c",
    "ps": "#9467bd", "recursive-doubling": "#ff7f0e", "rabenseifner": "#8c564b", "gloo": "#7f7f7f",
    "dimd": "#d62728", "ddp": "#7f7f7f",
}
#: The baseline every figure compares against (MPI's own allreduce, data in memory, ...).
BASELINE = {"color": "black", "linestyle": "--", "linewidth": 2.0, "zorder": 5}
FALLBACK_COLORS = ["#bcbd22", "#e377c2", "#393b79", "#637939", "#8c6d31", "#843c39"]


def check_pillow_simd() -> str:
    """The PIL that matplotlib will write PNGs with must be pillow-simd; return its version."""
    import importlib.metadata as metadata

    try:
        metadata.version("pillow")
    except metadata.PackageNotFoundError:
        pass
    else:
        raise RuntimeError("plain Pillow is installed over pillow-simd; run `make setup` to restore it")
    try:
        files = metadata.files("pillow-simd") or []
    except metadata.PackageNotFoundError:
        raise RuntimeError("pillow-simd is not installed; run `make setup`") from None
    import PIL

    if not any(Path(str(f)).as_posix() == "PIL/__init__.py" for f in files):
        raise RuntimeError(f"PIL at {PIL.__file__} does not come from pillow-simd")
    return PIL.__version__


def pyplot():
    """matplotlib.pyplot on the Agg backend, with the common style."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("matplotlib is not installed; run `make plots-setup`") from None
    check_pillow_simd()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "figure.dpi": 100, "savefig.dpi": 110, "font.size": 9, "axes.titlesize": 10,
        "axes.labelsize": 9, "legend.fontsize": 7.5, "axes.grid": True, "grid.alpha": 0.3,
        "axes.spines.top": False, "axes.spines.right": False,
    })
    return plt


def figure(rows: int = 1, cols: int = 1, *, width: float = 6.4, height: float = 4.2, **kwargs):
    """A figure and its axes (always a 2-D array), sized per panel."""
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, **kwargs)
    return fig, axes


def color(name: str, index: int = 0) -> str:
    return COLORS.get(name, FALLBACK_COLORS[index % len(FALLBACK_COLORS)])


def format_bytes(n: float) -> str:
    """dimd's own byte format, whole sizes without the ".0" (axis ticks): ``64 KiB``, ``1.5 MiB``."""
    from dimd.units import format_bytes as dimd_format

    return dimd_format(n).replace(".0 ", " ")


def bytes_axis(ax: Any, sizes: Sequence[float], axis: str = "x") -> None:
    """A log2 axis of byte counts labelled 8 B, 1 KiB, 1 MiB..., at most about seven labels."""
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    low, high = math.floor(math.log2(max(min(sizes), 1))), math.ceil(math.log2(max(max(sizes), 1)))
    step = max(1, math.ceil((high - low + 1) / 7))
    ticks = [2.0**k for k in range(high, low - 1, -step)]
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    target.set_major_locator(FixedLocator(sorted(ticks)))
    target.set_minor_locator(NullLocator())
    target.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))


def series(ax: Any, x: Sequence[float], spreads: Sequence[dict], label: str, *, style: dict | None = None,
           band: bool = True, marker: str = "o") -> None:
    """Medians as a line with markers, the min-max spread as a shaded band."""
    xs = [a for a, s in zip(x, spreads) if s and s.get("median") is not None]
    good = [s for s in spreads if s and s.get("median") is not None]
    if not xs:
        return
    style = {"color": color(label), **(style or {})}
    ax.plot(xs, [s["median"] for s in good], marker=marker, markersize=3.5, label=label, **style)
    if band and any(s["max"] != s["min"] for s in good):
        ax.fill_between(xs, [s["min"] for s in good], [s["max"] for s in good], color=style["color"],
                        alpha=0.15, linewidth=0)


def baseline(ax: Any, x: Sequence[float], spreads: Sequence[dict], label: str) -> None:
    """The baseline as a series: black dashed, drawn over the others, its spread shaded grey."""
    series(ax, x, spreads, label, style=dict(BASELINE), marker="s")


def baseline_level(ax: Any, value: float | dict, label: str) -> None:
    """The baseline as one level across a bar chart, in the same black dashed line.

    Given a spread, the level is its median and its min-max range is shaded grey.
    """
    if isinstance(value, dict):
        if value.get("min") is not None and value["max"] != value["min"]:
            ax.axhspan(value["min"], value["max"], color="black", alpha=0.07, linewidth=0)
        value = value["median"]
    ax.axhline(value, label=label, **BASELINE)


def bars(ax: Any, positions: Sequence[float], spreads: Sequence[dict], *, width: float, label: str | None,
         color_: str, hatch: str | None = None, alpha: float = 0.9) -> Any:
    """Bars at the medians with min-max error bars; a spread without a median (no result) draws nothing."""
    kept = [(x, s) for x, s in zip(positions, spreads) if s and s.get("median") is not None]
    positions, spreads = [x for x, _ in kept], [s for _, s in kept]
    medians = [s["median"] for s in spreads]
    low = [m - s["min"] for m, s in zip(medians, spreads)]
    high = [s["max"] - m for m, s in zip(medians, spreads)]
    return ax.bar(positions, medians, width=width, label=label, color=color_, hatch=hatch, alpha=alpha,
                  yerr=[low, high], capsize=2, error_kw={"elinewidth": 0.8, "ecolor": "#333333"},
                  edgecolor="white", linewidth=0.5)


def shared_legend(fig: Any, ax: Any, *, width: float = 0.16) -> None:
    """One legend for the whole figure, to the right of the panels (``save`` leaves it the room)."""
    handles, labels = ax.get_legend_handles_labels()
    w, h = fig.get_size_inches()
    fig.set_size_inches(w / (1 - width), h)   # the panels keep their size; the legend gets the new room
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.dimd_legend_width = width


def scaled(s: dict, factor: float) -> dict:
    """A spread in other units (e.g. bytes to MiB)."""
    return {k: (v * factor if v is not None else None) for k, v in s.items() if k in ("median", "min", "max")}


def footnote_text(envelope: dict[str, Any]) -> str:
    """The machine, the commit, the date, the load and the size, in one line."""
    m = envelope.get("result", {}).get("machine", {})
    versions = envelope.get("versions", {})
    parameters = envelope.get("parameters", {})
    load = m.get("load_average") or ["?"]
    parts = [f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB",
             f"dimd {versions.get('dimd', '?')} commit {envelope.get('commit') or 'unknown'}",
             (envelope.get("date") or "")[:16].replace("T", " "),
             f"load average {load[0]} at the end",
             "--quick size (a smoke test, not a result)" if parameters.get("quick") else "full size"]
    return " · ".join(parts)


def save(fig: Any, path: Path, envelope: dict[str, Any], *, title: str | None = None,
         footnote: str | None = None) -> Path:
    """Add the title and footnote (``footnote``, else the envelope's machine and commit), write the PNG
    (through pillow-simd) and close the figure."""
    if title:
        fig.suptitle(title, fontsize=11, fontweight="bold")
    fig.text(0.005, 0.004, footnote_text(envelope) if footnote is None else footnote, fontsize=6.5,
             color="#555555", ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.025, 1 - getattr(fig, "dimd_legend_width", 0.0), 0.97 if title else 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    pyplot().close(fig)
    if "PIL.PngImagePlugin" not in sys.modules:
        raise RuntimeError(f"{path}: matplotlib wrote the PNG without Pillow; expected it to go through pillow-simd")
    return path
