"""DIMD figures 10-11: epoch time with the data in memory against reading every image from files,
where reading a file costs what it costs: in the page cache, cold from the disk, and on a network
file system with a set round trip.

The same ``mpiexec -n P dimd train`` runs five ways, ``runs`` times each (interleaved):

* ``memory``      the in-memory store (dimd's way);
* ``page cache``  ``--read-from files``: each image opened and read from its file on every access,
                  the files in the page cache after the first epoch (a local disk, a small set);
* ``cold disk``   ``--read-from files-cold``: the same, each file's cached pages dropped just before
                  it is read (``posix_fadvise(POSIX_FADV_DONTNEED)``), so every read goes to the disk;
* ``sshfs +R ms`` ``--read-from files`` from an sshfs mount of the same files over the loopback
                  interface (bench/netfs.sh), with R ms added to every round trip.

The files hold exactly the packed records' bytes (bench/_common.py's
``write_records_as_files``), so every way decodes the same JPEGs: only where
the bytes come from differs. The figure is the second epoch's training time.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from _common import BENCH, Context, Reproduction, dimd_job, sample_set, spread

MODELS = [
    # the paper's model and image size (GoogLeNet-BN at 224 px), on a set small enough for 2 CPU cores
    {"model": "googlenet-bn", "image_size": 224, "batch_size": 8, "classes": 10, "per_class": 8,
     "val_per_class": 1},
    # a light model at 32 px, whose compute no longer hides the reads: where the benefit appears
    {"model": "resnet20", "image_size": 32, "batch_size": 32, "classes": 10, "per_class": 64,
     "val_per_class": 2},
]
FULL = {"models": MODELS, "ranks": 2, "workers": 2, "epochs": 2, "runs": 3, "rtt_ms": [0.5, 2.0]}
QUICK = {"models": [{**MODELS[0], "image_size": 64, "per_class": 4}, {**MODELS[1], "per_class": 16}],
         "rtt_ms": [2.0]}
BASELINE = "memory"


def setups(rtt_ms: list[float]) -> list[dict[str, Any]]:
    ways = [{"setup": "memory", "read_from": "memory"}, {"setup": "page cache", "read_from": "files"},
            {"setup": "cold disk", "read_from": "files-cold"}]
    return ways + [{"setup": f"sshfs +{r:g} ms", "read_from": "files", "rtt_ms": r} for r in rtt_ms]


def netfs_available() -> str | None:
    """None when bench/netfs.sh can run here, else why not."""
    if os.geteuid() != 0:
        return "not root (sshd and FUSE need it)"
    if not (shutil.which("sshfs") and (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd"))):
        return "sshd or sshfs missing (make netfs-setup)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    p = ctx.size(FULL, QUICK)
    why_not = netfs_available()
    ways = [w for w in setups(p["rtt_ms"]) if "rtt_ms" not in w or why_not is None]
    panels = []
    datasets = {m["model"]: sample_set(m["classes"], m["per_class"], m["val_per_class"], log=ctx.log)
                for m in p["models"]}
    runs: dict[tuple[str, str], list[dict]] = {}
    for run in range(p["runs"]):
        for m in p["models"]:
            data = datasets[m["model"]]
            for way in ways:
                ctx.log(f"run {run + 1}/{p['runs']}: {m['model']} at {m['image_size']} px, {way['setup']}")
                tag = f"{m['model']}_{way['setup'].replace(' ', '_').replace('+', '')}_run{run}"
                root, wrap, info = data.files, [], None
                if "rtt_ms" in way:
                    root, info = ctx.folder("mnt"), ctx.folder() / f"{tag}_netfs.json"
                    wrap = [BENCH / "netfs.sh", "run", "--export", data.files, "--mount", root,
                            "--rtt-ms", way["rtt_ms"], "--info", info, "--"]
                doc = dimd_job(["train", data.train, "--val", data.val, "--model", m["model"],
                                "--image-size", m["image_size"], "--batch-size", m["batch_size"],
                                "--epochs", p["epochs"], "--lr", 0.05, "--schedule", "constant",
                                "--decode-workers", p["workers"], "--allreduce", "multicolor",
                                "--read-from", way["read_from"],
                                *(["--files-root", root] if way["read_from"] != "memory" else [])],
                               ctx.folder() / f"{tag}.json", ranks=p["ranks"], wrap=wrap)
                figures = doc["result"]
                if info is not None:
                    figures["netfs"] = json.loads(info.read_text())
                runs.setdefault((m["model"], way["setup"]), []).append(figures)
    for m in p["models"]:
        rows = []
        for way in ways:
            results = runs[(m["model"], way["setup"])]
            epochs = [r["history"][-1] for r in results]
            row = {"setup": way["setup"], "read_from": way["read_from"], "rtt_ms": way.get("rtt_ms"),
                   "epoch_seconds": spread(e["train_seconds"] for e in epochs),
                   "data_wait_seconds": spread(e["time_split"]["data"] for e in epochs),
                   "images_per_s": spread(e["images_per_s"] for e in epochs)}
            if "rtt_ms" in way:
                row["request_ms"] = spread(r["netfs"]["request_ms_measured"] for r in results)
            rows.append(row)
        first = runs[(m["model"], BASELINE)][0]
        panels.append({**m, "records": datasets[m["model"]].records, "steps_per_epoch": first["steps_per_epoch"],
                       "gradient_bytes": first["model"]["gradient_bytes"], "rows": rows})
    return p, {"panels": panels, "netfs_skipped": why_not}


def saving(row: dict, base: dict) -> float:
    """How much less time an epoch takes in memory than this way, in %."""
    return 100 * (1 - base["epoch_seconds"]["median"] / row["epoch_seconds"]["median"])


def plot(envelope: dict[str, Any]):
    from dimd import plotting

    panels = envelope["result"]["panels"]
    fig, axes = plotting.figure(1, len(panels) + 1, width=4.3, height=4.1)
    palette = {"page cache": "#1f77b4", "cold disk": "#2ca02c"}
    for ax, panel in zip(axes[0], panels):
        rows = panel["rows"]
        base = next(r for r in rows if r["setup"] == BASELINE)
        others = [r for r in rows if r["setup"] != BASELINE]
        colours = [palette.get(r["setup"], "#ff7f0e" if "0.5" in r["setup"] else "#d62728") for r in others]
        for i, (row, colour) in enumerate(zip(others, colours)):
            plotting.bars(ax, [i], [row["epoch_seconds"]], width=0.65, label=None, color_=colour)
            ax.annotate(f"{saving(row, base):+.0f}%", (i, row["epoch_seconds"]["max"]), ha="center",
                        va="bottom", fontsize=7.5, xytext=(0, 2), textcoords="offset points",
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
        plotting.baseline_level(ax, base["epoch_seconds"], "in memory (dimd), its spread shaded")
        ax.set_xticks(range(len(others)), [r["setup"].replace(" +", "\n+") for r in others], fontsize=7.5)
        ax.set_ylabel("epoch time (s, training only)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{panel['model']} at {panel['image_size']} px, {panel['records']} images", fontsize=9)
        ax.legend(loc="lower right", fontsize=7)
    ax = axes[0][-1]
    for panel in panels:
        base = next(r for r in panel["rows"] if r["setup"] == BASELINE)
        others = [r for r in panel["rows"] if r["setup"] != BASELINE]
        ax.plot(range(len(others)), [saving(r, base) for r in others], marker="o",
                label=f"{panel['model']} {panel['image_size']} px")
        ax.set_xticks(range(len(others)), [r["setup"].replace(" +", "\n+") for r in others], fontsize=7.5)
    ax.axhline(0, **plotting.BASELINE)
    ax.axhspan(25, 33, color="#999999", alpha=0.2, label="the paper: 25-33%")
    ax.set_ylabel("epoch time saved in memory (%)")
    ax.set_title("the in-memory saving, by source", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def findings(envelope: dict[str, Any]) -> str:
    result, p = envelope["result"], envelope["parameters"]
    lines = [f"P = {p['ranks']} ranks, {p['workers']} decoding workers each, second-epoch training time, "
             f"medians of {p['runs']} runs. The round trips are added by bench/delay_proxy.py on the sshfs "
             f"connection (this kernel has no netem)."]
    for panel in result["panels"]:
        rows = panel["rows"]
        base = next(r for r in rows if r["setup"] == BASELINE)
        cells = []
        for r in rows:
            if r["setup"] == BASELINE:
                continue
            cell = (f"{r['setup']} {r['epoch_seconds']['median']:.2f} s ({saving(r, base):+.0f}%; waiting for "
                    f"data {r['data_wait_seconds']['median']:.2f} s")
            if r.get("request_ms"):
                cell += f"; one request {r['request_ms']['median']:.1f} ms"
            cells.append(cell + ")")
        lines.append(f"**{panel['model']} at {panel['image_size']} px** ({panel['records']} images, batch "
                     f"{panel['batch_size']} per rank): in memory {base['epoch_seconds']['median']:.2f} s "
                     f"({base['epoch_seconds']['min']:.2f}-{base['epoch_seconds']['max']:.2f}), waiting for data "
                     f"{base['data_wait_seconds']['median']:.2f} s; " + "; ".join(cells) + ".")
    lines.append("Percentages: the epoch time saved by holding the data in memory. The loader reads and decodes "
                 "the next batches in threads while the model computes, so reading files costs epoch time only "
                 "where a batch takes longer to read than to compute; \"waiting for data\" is that excess, "
                 "per rank.")
    if result.get("netfs_skipped"):
        lines.append(f"The sshfs set-ups were skipped: {result['netfs_skipped']}.")
    return "\n\n".join(lines)


REPRODUCTION = Reproduction(
    name="memory_vs_files",
    title="DIMD figures 10-11: epoch time in memory against reading files",
    claim=("On ImageNet-1k with 8-32 learners reading from the cluster's shared file system, holding the data "
           "in memory (DIMD) cuts the time per epoch by 33% for GoogLeNet-BN and 25% for ResNet-50."),
    measure=measure, plot=plot, findings=findings, minutes=5.0)
