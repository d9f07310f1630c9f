"""DIMD figures 7-9: shuffle time against ranks and groups, with a bare MPI_Alltoallv as the limit.

A synthetic packed set of random bytes with ImageNet-like record sizes
(log-normal around 110 KB, the size of an ImageNet JPEG at short side 256; a
shuffle never decodes, so the bytes' content does not matter, their sizes
do). For each (P, G), ``runs`` times: the real command

    mpiexec -n P dimd shuffle DATA --groups G --rounds R --quiet --json ...

(its figure: the median round time, each round's time the slowest rank's),
and ``bench/bare_alltoallv.py`` moving the same bytes per rank with one
plain Alltoallv, the limit the record bookkeeping is measured against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from _common import BENCH, WORK, Context, Reproduction, dimd_job, mpi_python, spread

FULL = {"size_mib": 512, "mean_record_kb": 110, "configs": [[2, 1], [3, 1], [4, 1], [4, 2]], "rounds": 5,
        "runs": 3}
QUICK = {"size_mib": 24, "rounds": 3}
BASELINE = "bare MPI_Alltoallv of the same bytes"


def synthetic_pack(stem: Path, total_bytes: int, mean_record: int, seed: int = 0) -> int:
    """Random-byte records with log-normal sizes around ``mean_record``; returns the record count."""
    from dimd.format import PackedRecord, PackWriter

    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(mean_record), 0.5, 2 * total_bytes // mean_record + 16),
                    2_000, 2_000_000).astype(np.int64)
    sizes = sizes[: int(np.searchsorted(np.cumsum(sizes), total_bytes)) + 1]
    pool = rng.integers(0, 256, int(sizes.max()) + 4096, dtype=np.uint8).tobytes()
    with PackWriter(stem, force=True) as writer:
        for i, n in enumerate(sizes.tolist()):
            start = int(rng.integers(0, 4096))
            writer.add(PackedRecord(pool[start : start + n], i % 1000, f"synthetic/{i:08d}", 256, 256))
        writer.commit([f"c{i}" for i in range(1000)], short_side=256, quality=0, source="synthetic")
    return len(sizes)


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    p = ctx.size(FULL, QUICK)
    stem = WORK / "data" / f"synthetic_{p['size_mib']}M_{p['mean_record_kb']}K" / "train"
    if not (stem.parent / ".complete").exists():
        ctx.log(f"writing a {p['size_mib']} MiB synthetic set to {stem}")
        stem.parent.mkdir(parents=True, exist_ok=True)
        synthetic_pack(stem, p["size_mib"] << 20, p["mean_record_kb"] * 1000)
        (stem.parent / ".complete").touch()
    data_bytes = stem.with_suffix(".dimd").stat().st_size
    shuffles: dict[tuple[int, int], list[dict]] = {}
    bares: dict[tuple[int, int], list[dict]] = {}
    for run in range(p["runs"]):
        for ranks, groups in p["configs"]:
            key = (ranks, groups)
            ctx.log(f"run {run + 1}/{p['runs']}: shuffle and bare Alltoallv at P={ranks}, G={groups}")
            shuffles.setdefault(key, []).append(dimd_job(
                ["shuffle", stem, "--groups", groups, "--rounds", p["rounds"], "--quiet"],
                ctx.folder() / f"p{ranks}_g{groups}_run{run}.json", ranks=ranks)["result"])
            bares.setdefault(key, []).append(mpi_python(
                ranks, BENCH / "bare_alltoallv.py",
                ["--share", data_bytes * groups // ranks, "--rounds", p["rounds"], "--groups", groups],
                ctx.folder() / f"bare_p{ranks}_g{groups}_run{run}.json", "bench/bare_alltoallv.py")["result"])
    rows = []
    for key, docs in shuffles.items():
        ranks, groups = key
        bare = bares[key]
        rows.append({
            "ranks": ranks, "groups": groups, "group_size": ranks // groups,
            "shuffle_seconds": spread(d["summary"]["seconds_median"] for d in docs),
            "bytes_moved": float(np.median([d["summary"]["bytes_moved_median"] for d in docs])),
            "gb_per_s": spread(d["summary"]["gb_per_s_median"] for d in docs),
            "load_seconds": spread(d["load"]["seconds"] for d in docs),
            "resident_bytes_mean": spread(np.mean([np.mean(r["resident_bytes"]) for r in d["rounds"]])
                                          for d in docs),
            "resident_bytes_max": spread(max(max(r["resident_bytes"]) for r in d["rounds"]) for d in docs),
            "bare_seconds": spread(float(np.median(b["seconds"])) for b in bare),
            "bare_bytes_moved": bare[0]["bytes_moved"],
        })
    return p, {"records": int(shuffles[next(iter(shuffles))][0]["records"]), "data_bytes": data_bytes,
               "rows": rows}


def plot(envelope: dict[str, Any]):
    from dimd import plotting

    result = envelope["result"]
    rows = result["rows"]
    fig, axes = plotting.figure(1, 3, width=4.2, height=3.9)
    by_ranks = sorted((r for r in rows if r["groups"] == 1), key=lambda r: r["ranks"])
    ax = axes[0][0]
    ranks = [r["ranks"] for r in by_ranks]
    plotting.series(ax, ranks, [r["shuffle_seconds"] for r in by_ranks], "dimd shuffle", style={"color": "#d62728"})
    plotting.baseline(ax, ranks, [r["bare_seconds"] for r in by_ranks], BASELINE)
    ax.set_xticks(ranks)
    ax.set_xlabel("ranks P (one group)")
    ax.set_ylabel("time per shuffle (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"whole set, {plotting.format_bytes(result['data_bytes'])} (figs. 7-8)")
    ax.legend()

    ax = axes[0][1]
    top = max(r["ranks"] for r in rows)
    by_groups = sorted((r for r in rows if r["ranks"] == top), key=lambda r: r["groups"])
    groups = [r["groups"] for r in by_groups]
    plotting.series(ax, groups, [r["shuffle_seconds"] for r in by_groups], "dimd shuffle", style={"color": "#d62728"})
    plotting.baseline(ax, groups, [r["bare_seconds"] for r in by_groups], BASELINE)
    ax.set_xticks(groups, [f"{g} ({top // g} ranks each)" for g in groups])
    ax.set_xlabel(f"groups G at P = {top}")
    ax.set_ylabel("time per shuffle (s)")
    ax.set_ylim(bottom=0)
    ax.set_title("group shuffle (fig. 9)")

    ax = axes[0][2]
    mib = 2**20
    plotting.bars(ax, range(len(ranks)), [plotting.scaled(r["resident_bytes_mean"], 1 / mib) for r in by_ranks],
                  width=0.6, label="mean over ranks and rounds", color_="#d62728")
    share = result["data_bytes"] / mib
    ax.plot(range(len(ranks)), [share / p for p in ranks], **plotting.BASELINE, marker="s",
            label="the rank's share of the data")
    ax.set_xticks(range(len(ranks)), [f"P = {p}" for p in ranks])
    ax.set_ylabel("resident memory per rank (MiB)")
    ax.set_title("memory per rank (figs. 7-8)")
    ax.legend()
    return fig


def findings(envelope: dict[str, Any]) -> str:
    result, p = envelope["result"], envelope["parameters"]
    rows = result["rows"]
    lines = [f"{result['records']} records, {result['data_bytes'] / 2**20:.0f} MiB (ImageNet-like sizes, mean "
             f"{p['mean_record_kb']} KB), {p['rounds']} shuffles per run, medians of {p['runs']} runs."]
    cells = []
    for r in sorted(rows, key=lambda r: (r["groups"], r["ranks"])):
        ratio = r["shuffle_seconds"]["median"] / r["bare_seconds"]["median"]
        cells.append(f"P = {r['ranks']}, G = {r['groups']}: {r['shuffle_seconds']['median']:.3f} s "
                     f"({r['shuffle_seconds']['min']:.3f}-{r['shuffle_seconds']['max']:.3f}), "
                     f"{r['gb_per_s']['median']:.2f} GB/s, {ratio:.2f}x the bare Alltoallv")
    lines.append("; ".join(cells) + ".")
    ones = sorted((r for r in rows if r["groups"] == 1), key=lambda r: r["ranks"])
    if len(ones) > 1:
        first, last = ones[0]["shuffle_seconds"]["median"], ones[-1]["shuffle_seconds"]["median"]
        lines.append(f"With one group, from P = {ones[0]['ranks']} to P = {ones[-1]['ranks']} the shuffle time "
                     f"changes by {100 * (last / first - 1):+.0f}%. In the paper it falls as learners are added, "
                     "each bringing its node's links and memory bandwidth; here all ranks share one machine's "
                     "two cores and memory bus.")
    return "\n\n".join(lines)


REPRODUCTION = Reproduction(
    name="shuffle_scaling",
    title="DIMD figures 7-9: shuffle time against ranks and groups",
    claim=("The in-memory shuffle of ImageNet-1k (70 GB) and -22k (220 GB) takes less time as learners grow "
           "from 8 to 32 (4.2 s for ImageNet-22k on 32 learners), with memory per learner falling as its share "
           "does; splitting 32 learners into 4-16 groups barely changes the time on a cluster whose links "
           "are all alike."),
    measure=measure, plot=plot, findings=findings, minutes=1.0)
