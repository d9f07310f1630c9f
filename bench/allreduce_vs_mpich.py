"""dimd's allreduce algorithms against the same ideas inside MPICH (opt-in: not in `make reproduce`).

Per P and run: ``dimd bench-allreduce -a mpi,ring,recursive-doubling,rabenseifner,tree`` and, once per
MPICH algorithm, ``dimd bench-allreduce -a mpi`` with ``MPIR_CVAR_DEVICE_COLLECTIVES=none
MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=<alg>`` (MPICH's own ring, recursive doubling,
reduce-scatter + allgather and tree, forced). Each time is taken relative to MPICH's default
measured in the first job of the same run, and the spread is over runs of that ratio: is a
Python algorithm slower than the same algorithm in C, and by how much.
"""

from __future__ import annotations

from typing import Any

from _common import Context, Reproduction, dimd_job, spread

#: dimd algorithm -> the MPICH algorithm that is the same idea
MPICH_PEERS = {"ring": "ring", "recursive-doubling": "recursive_doubling",
               "rabenseifner": "reduce_scatter_allgather", "tree": "tree"}
FULL = {"ranks": [2, 4], "runs": 3, "min_bytes": 64 << 10, "max_bytes": 64 << 20, "factor": 4}
QUICK = {"ranks": [2], "max_bytes": 1 << 20, "factor": 16}


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    p = ctx.size(FULL, QUICK)
    sweep = ["-b", p["min_bytes"], "-e", p["max_bytes"], "-f", p["factor"]]
    ratios: dict[tuple[int, str, int], list[float]] = {}
    for run in range(p["runs"]):
        for ranks in p["ranks"]:
            ctx.log(f"run {run + 1}/{p['runs']}: P={ranks}, dimd and MPICH's forced algorithms")
            folder = ctx.folder()
            doc = dimd_job(["bench-allreduce", "-a", ",".join(["mpi", *MPICH_PEERS]), *sweep],
                           folder / f"p{ranks}_run{run}_dimd.json", ranks=ranks)
            rows = list(doc["result"]["rows"])
            default = {r["bytes"]: r["time_us"] for r in rows if r["algorithm"] == "mpi"}
            for mpich in MPICH_PEERS.values():
                forced = dimd_job(["bench-allreduce", "-a", "mpi", *sweep],
                                  folder / f"p{ranks}_run{run}_mpich_{mpich}.json", ranks=ranks,
                                  env={"MPIR_CVAR_DEVICE_COLLECTIVES": "none",
                                       "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": mpich})
                rows += [{**r, "algorithm": f"mpich:{mpich}"} for r in forced["result"]["rows"]]
            for r in rows:
                ratios.setdefault((ranks, r["algorithm"], r["bytes"]), []).append(r["time_us"] / default[r["bytes"]])
    rows_out = [{"ranks": ranks, "algorithm": algorithm, "bytes": nbytes, "vs_default": spread(values)}
                for (ranks, algorithm, nbytes), values in sorted(ratios.items())]
    return p, {"rows": rows_out, "peers": MPICH_PEERS}


def plot(envelope: dict[str, Any]):
    from dimd import plotting

    rows = envelope["result"]["rows"]
    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plotting.figure(1, len(ranks), width=5.6, height=4.2)
    for ax, p in zip(axes[0], ranks):
        mine = [r for r in rows if r["ranks"] == p]
        sizes = sorted({r["bytes"] for r in mine})
        for algorithm, mpich in envelope["result"]["peers"].items():
            colour = plotting.color(algorithm)
            for name, style in ((algorithm, {"color": colour}),
                                (f"mpich:{mpich}", {"color": colour, "linestyle": ":", "alpha": 0.8})):
                series = {r["bytes"]: r["vs_default"] for r in mine if r["algorithm"] == name}
                plotting.series(ax, sizes, [series.get(n) for n in sizes],
                                name if name == algorithm else f"MPICH's {mpich}", style=style)
        ax.axhline(1.0, label="MPICH's default", **plotting.BASELINE)
        ax.set_yscale("log")
        plotting.bytes_axis(ax, sizes)
        ax.set_xlabel("message size (bytes, float32)")
        ax.set_ylabel("time / MPICH's default in the same run")
        ax.set_title(f"P = {p}: dimd (solid) and MPICH forced (dotted)")
    plotting.shared_legend(fig, axes[0][0], width=0.3 if len(ranks) == 1 else 0.2)
    return fig


def findings(envelope: dict[str, Any]) -> str:
    rows, p = envelope["result"]["rows"], envelope["parameters"]
    lines = []
    for ranks in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == ranks]
        big = max(r["bytes"] for r in mine)
        at = {r["algorithm"]: r["vs_default"]["median"] for r in mine if r["bytes"] == big}
        cells = [f"{a} {at[a]:.2f}x against MPICH's {m} {at[f'mpich:{m}']:.2f}x"
                 for a, m in envelope["result"]["peers"].items() if a in at and f"mpich:{m}" in at]
        lines.append(f"**P = {ranks}**, {big / 2**20:.0f} MiB, time relative to MPICH's default (median of "
                     f"{p['runs']} runs): " + "; ".join(cells) + ".")
    return "\n\n".join(lines)


REPRODUCTION = Reproduction(
    name="allreduce_vs_mpich",
    title="dimd's allreduce algorithms against MPICH's own, forced",
    claim=("(Not a figure of the papers.) The DIMD paper replaces the MPI library's allreduce with its own "
           "algorithm; here each dimd algorithm (Python over mpi4py) meets the same algorithm inside MPICH "
           "(C), forced with MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM."),
    measure=measure, plot=plot, findings=findings, minutes=8.0, default=False)
