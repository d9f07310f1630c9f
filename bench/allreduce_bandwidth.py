"""DIMD figure 5: allreduce throughput against message size, every algorithm, MPI's own and gloo.

Runs ``mpiexec -n P dimd bench-allreduce -a all --peer gloo --json ...`` at
each P, ``runs`` times (interleaved over P, so drift hits every P alike), and
takes per algorithm and size the spread over runs of the time, algbw, busbw
and the time relative to MPI's own ``MPI_Allreduce`` measured in the same run.
"""

from __future__ import annotations

import functools
from typing import Any

from _common import Context, Reproduction, dimd_job, spread
from dimd.plotting import format_bytes

FULL = {"ranks": [2, 4], "runs": 3, "min_bytes": 4, "max_bytes": 64 << 20, "factor": 4}
QUICK = {"max_bytes": 1 << 20, "factor": 16}
BASELINE = "mpi"


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    p = ctx.size(FULL, QUICK)
    raw: dict[int, list[dict]] = {ranks: [] for ranks in p["ranks"]}
    for run in range(p["runs"]):
        for ranks in p["ranks"]:
            ctx.log(f"run {run + 1}/{p['runs']}: bench-allreduce at P={ranks}")
            raw[ranks].append(dimd_job(
                ["bench-allreduce", "-a", "all", "--peer", "gloo", "-b", p["min_bytes"], "-e", p["max_bytes"],
                 "-f", p["factor"]], ctx.folder() / f"p{ranks}_run{run}.json", ranks=ranks))
    return p, {"panels": [summarise(ranks, docs) for ranks, docs in raw.items()]}


def summarise(ranks: int, docs: list[dict]) -> dict[str, Any]:
    """Per algorithm and size, the spread over runs of time, algbw, busbw and time / MPI's time."""
    rows = [row for doc in docs for row in doc["result"]["rows"]]
    sizes = sorted({row["bytes"] for row in rows})
    algorithms = list(dict.fromkeys(row["algorithm"] for row in rows))
    series = {}
    for algorithm in algorithms:
        mine = {size: [r for r in rows if r["algorithm"] == algorithm and r["bytes"] == size] for size in sizes}
        series[algorithm] = {key: [spread(r[key] for r in mine[size]) for size in sizes]
                             for key in ("time_us", "algbw_gbs", "busbw_gbs")}
        series[algorithm]["vs_mpi"] = [spread(r["vs_mpi"] for r in mine[size] if r["vs_mpi"] is not None)
                                       for size in sizes]
    return {"ranks": ranks, "sizes": sizes, "series": series, "runs": len(docs), "mpi": docs[0]["mpi"],
            "versions": docs[0]["versions"]}


def plot(envelope: dict[str, Any]):
    from dimd import plotting

    panels = envelope["result"]["panels"]
    fig, axes = plotting.figure(len(panels), 2, width=5.6, height=3.9)
    for row, panel in zip(axes, panels):
        for ax, key, what in ((row[0], "algbw_gbs", "algbw"), (row[1], "busbw_gbs", "busbw = algbw x 2(P-1)/P")):
            for algorithm, s in panel["series"].items():
                if algorithm == BASELINE:
                    plotting.baseline(ax, panel["sizes"], s[key], "MPI_Allreduce (MPICH's default)")
                else:
                    style = {"linestyle": ":"} if algorithm == "gloo" else None
                    plotting.series(ax, panel["sizes"], s[key], algorithm, style=style)
            ax.set_yscale("log")
            plotting.bytes_axis(ax, panel["sizes"])
            ax.set_xlabel("message size (bytes, float32)")
            ax.set_ylabel(f"{what} (GB/s)")
            ax.set_title(f"P = {panel['ranks']} ranks: {what.split(' ')[0]}")
    plotting.shared_legend(fig, axes[0][0], width=0.19)
    return fig


def findings(envelope: dict[str, Any]) -> str:
    lines = []
    for panel in envelope["result"]["panels"]:
        sizes, series = panel["sizes"], panel["series"]
        big = len(sizes) - 1
        dimd = {a: s for a, s in series.items() if a not in (BASELINE, "gloo")}
        ratio = functools.partial(_ratio, series)

        ranked = sorted(dimd, key=lambda a: ratio(a, big))
        best = ranked[0]
        cells = ", ".join(f"{a} {ratio(a, big):.2f}x" for a in ranked)
        faster = [min(ratio(a, i) for a in dimd) < 1.0 for i in range(len(sizes))]
        from_size = next((sizes[i] for i in range(len(sizes)) if all(faster[i:])), None)
        text = (f"**P = {panel['ranks']}**, at {format_bytes(sizes[big])}: MPICH's default takes "
                f"{series[BASELINE]['time_us'][big]['median'] / 1e3:.1f} ms "
                f"({series[BASELINE]['busbw_gbs'][big]['median']:.3g} GB/s busbw); each dimd algorithm's time "
                f"relative to it (median over {panel['runs']} runs of the ratio within a run): {cells}. "
                f"The fastest, {best}, reaches {dimd[best]['busbw_gbs'][big]['median']:.3g} GB/s busbw.")
        if "multicolor" in dimd and "ring-root" in dimd:
            text += (f" The paper's pair: multicolor {ratio('multicolor', big):.2f}x, ring-root "
                     f"{ratio('ring-root', big):.2f}x MPICH's time.")
        if from_size is not None:
            text += (f" From {format_bytes(from_size)} up, some dimd algorithm is faster than MPICH's default "
                     "at every size.")
        else:
            text += " At no size from which on a dimd algorithm stays faster than MPICH's default."
        if "gloo" in series:
            text += f" gloo takes {ratio('gloo', big):.2f}x MPICH's time at {format_bytes(sizes[big])}."
        small = min(ratio(a, 0) for a in dimd)
        text += (f" At {format_bytes(sizes[0])} the best dimd algorithm takes {small:.2g}x MPICH's time"
                 + (" (every mpi4py message costs about 1.4 us in Python; MPICH's own shared-memory "
                    "allreduce about 0.3 us)." if small > 1 else "."))
        lines.append(text)
    return "\n\n".join(lines)


def _ratio(series: dict[str, Any], algorithm: str, i: int) -> float:
    """The median over runs of an algorithm's time / MPICH's time in the same run, at size index i."""
    return series[algorithm]["vs_mpi"][i]["median"]


REPRODUCTION = Reproduction(
    name="allreduce_bandwidth",
    title="DIMD figure 5: allreduce throughput against message size",
    claim=("On 16 POWER8 nodes (64 GPUs, 2 x 100 Gb/s InfiniBand each), the 4-colour multicolor allreduce "
           "reaches a higher throughput than Open MPI's default MPI_Allreduce and than the pipelined "
           "ring-to-root (`ring-root` here) at the large messages of gradient exchange."),
    measure=measure, plot=plot, findings=findings, minutes=2.0)
