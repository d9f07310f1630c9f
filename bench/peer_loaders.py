"""dimd against the loaders users would pick instead: packing time and training-batch throughput
on the same image tree, for dimd, FFCV, litdata, webdataset and torchvision's ImageFolder.

Opt-in (``make bench-peers``): each peer lives in a venv of its own under build/peers/NAME
(bench/peers/setup.sh; several GB, the CUDA torch build for torchvision among them) and runs
as bench/peers/NAME_peer.py with that venv's Python, so dimd never imports a peer and no two
peers share a Pillow (dimd's is pillow-simd; FFCV needs plain Pillow).

The same images for everyone:

1. ``dimd sample-data`` writes an ImageNet-like class tree (300-720 px, 15% 1000-2200 px);
2. ``dimd pack --workers W`` resizes it to short side 256 (timed: the pack a dimd user runs);
3. each packed record's bytes go to a manifest folder (``files/NAME`` + ``manifest.tsv``:
   name, label, crc32, length, height, width), and every peer writes exactly those bytes
   into its format (timed: the write alone), so no decoder gets an easier image;
4. every format is read back raw and checked against the tree: count, each name once,
   its label (the tree's sorted class folders), length and crc32 of its bytes;
5. each loader makes training batches (``B`` images, random-resized crop to 224 px, scale
   0.08-1, ratio 3/4-4/3, random horizontal flip, uint8 N x 3 x 224 x 224) with W workers:
   a process of its own per run, one warm-up epoch, then one measured epoch; the images
   counted are those actually delivered in batches. Runs are interleaved (run 1 of every
   loader, then run 2, ...), so load from other jobs hits every loader alike.

torchvision's ImageFolder runs twice: over the same short-side-256 files, and over the
original files (what a user who never packs does). Its figure is the baseline.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path
from typing import Any

from _common import BENCH, BIN, Context, JobError, Reproduction, dimd_job, json_job, run, spread, write_records_as_files

ROOT = BENCH.parent
PEERS_DIR = Path(os.environ.get("DIMD_PEERS_DIR", ROOT / "build" / "peers"))
SCRIPTS = BENCH / "peers"
#: the peers bench/peers/setup.sh installs (dimd runs in this environment)
INSTALLED = ("ffcv", "litdata", "webdataset", "torchvision")

#: the loaders, in the figure's order: (label, peer module, which data it reads)
LOADERS = [
    ("dimd", "dimd", "format"),
    ("FFCV", "ffcv", "format"),
    ("litdata", "litdata", "format"),
    ("webdataset", "webdataset", "format"),
    ("ImageFolder, 256 px files", "torchvision", "format"),
    ("ImageFolder, original files", "torchvision", "originals"),
]
BASELINE = "ImageFolder, original files"
#: the formats written from the same bytes (torchvision's "format" is one file per image)
FORMATS = [("dimd", "dimd"), ("FFCV", "ffcv"), ("litdata", "litdata"), ("webdataset", "webdataset"),
           ("files (ImageFolder)", "torchvision")]

FULL = {"classes": 10, "per_class": 160, "seed": 1, "workers": 2, "batch_size": 64, "image_size": 224,
        "warmup_epochs": 1, "epochs": 1, "runs": 5}
QUICK = {"per_class": 12, "batch_size": 16, "runs": 2}
COLOURS = {"dimd": "#d62728", "FFCV": "#1f77b4", "litdata": "#9467bd", "webdataset": "#2ca02c",
           "ImageFolder, 256 px files": "#ff7f0e", "files (ImageFolder)": "#ff7f0e",
           "ImageFolder, original files": "#7f7f7f", "dimd pack (resize + write)": "#f4a6a6"}


# ---------------------------------------------------------------------------- the peers' venvs
def peer_python(peer: str) -> tuple[Path | None, str | None]:
    """(the Python that runs ``peer``, None) or (None, why it is unavailable)."""
    if peer == "dimd":
        return BIN / "python", None
    venv = PEERS_DIR / peer
    failed = venv / "FAILED"
    if failed.exists():
        return None, failed.read_text().strip()
    if not (venv / "INSTALLED").exists() or not (venv / "bin" / "python").exists():
        return None, f"not installed in {venv} (run `bench/peers/setup.sh {peer}` or `make bench-peers`)"
    return venv / "bin" / "python", None


def peer_job(peer: str, command: str, args: list[Any], json_path: Path) -> dict:
    python, why = peer_python(peer)
    if python is None:
        raise JobError(f"{peer} is unavailable: {why}")
    json_job([python, SCRIPTS / f"{peer}_peer.py", command, *args], json_path, env={"PYTHONDONTWRITEBYTECODE": "1"})
    import json

    return json.loads(json_path.read_text())


# ---------------------------------------------------------------------------- the images
def tree_listing(root: Path) -> list[tuple[str, int]]:
    """(relative path, label) of every file of a class tree, labels from the sorted class folders."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    found = []
    for label, name in enumerate(classes):
        for path in sorted((root / name).rglob("*")):
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), label))
    return found


def write_manifest(stem: Path, folder: Path) -> int:
    """The packed records as the peers read them: files/NAME, manifest.tsv, classes.txt."""
    from dimd.format import PackedDataset

    if folder.exists():
        shutil.rmtree(folder)
    count = write_records_as_files(stem, folder / "files")
    packed = PackedDataset(stem)
    rows = packed.records
    lines = ["name\tlabel\tcrc32\tlength\theight\twidth"]
    lines += [f"{name}\t{int(r['label'])}\t{int(r['crc32'])}\t{int(r['length'])}\t{int(r['height'])}\t"
              f"{int(r['width'])}" for name, r in zip(packed.names, rows)]
    (folder / "manifest.tsv").write_text("\n".join(lines) + "\n")
    (folder / "classes.txt").write_text("".join(f"{c}\n" for c in packed.classes))
    return count


def read_manifest(folder: Path) -> list[dict]:
    lines = (folder / "manifest.tsv").read_text().splitlines()
    keys = lines[0].split("\t")
    return [dict(zip(keys, line.split("\t"))) for line in lines[1:] if line]


def _stem(name: str) -> str:
    base, dot, extension = name.rpartition(".")
    return base if dot and "/" not in extension else name


def check_records(found_tsv: Path, expected: list[dict], *, bytes_known: bool = True) -> dict:
    """A format's records (``verify``'s TSV) against the tree's: count, names, labels, length, crc32.

    Names are compared without their extension (webdataset keeps the key only).
    """
    want = {_stem(r["name"]): r for r in expected}
    lines = found_tsv.read_text().splitlines()[1:]
    seen: dict[str, int] = {}
    wrong_label = wrong_bytes = unknown = 0
    for line in lines:
        name, label, crc, length = line.split("\t")
        key = _stem(name)
        seen[key] = seen.get(key, 0) + 1
        record = want.get(key)
        if record is None:
            unknown += 1
            continue
        if int(label) != int(record["label"]):
            wrong_label += 1
        if bytes_known and (int(crc) != int(record["crc32"]) or int(length) != int(record["length"])):
            wrong_bytes += 1
    missing = sum(1 for key in want if key not in seen)
    duplicated = sum(n - 1 for n in seen.values() if n > 1)
    problems = {"missing": missing, "duplicated": duplicated, "unknown": unknown, "wrong_label": wrong_label}
    if bytes_known:
        problems["wrong_bytes"] = wrong_bytes
    return {"records": len(lines), "expected": len(expected), **problems,
            "ok": len(lines) == len(expected) and not any(problems.values()),
            "checked": "count, names, labels" + (", length and crc32 of the bytes" if bytes_known else "")}


def prepare(ctx: Context, p: dict) -> tuple[Path, list[dict]]:
    """The original tree (generated once per set of parameters) and its listing."""
    base = ctx.work / "data" / f"peers-c{p['classes']}x{p['per_class']}s{p['seed']}"
    images = base / "images"
    if not (base / ".complete").exists():
        ctx.log(f"generating {p['classes'] * p['per_class']} images in {images}")
        if images.exists():
            shutil.rmtree(images)
        run([BIN / "dimd", "sample-data", images, "--classes", p["classes"], "--per-class", p["per_class"],
             "--seed", p["seed"]])
        (base / ".complete").touch()
    return images, [{"name": n, "label": label} for n, label in tree_listing(images)]


# ---------------------------------------------------------------------------- measuring
def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    p = ctx.size(FULL, QUICK)
    images, tree = prepare(ctx, p)
    work = ctx.folder()
    formats = work / "formats"
    manifest = work / "manifest"
    unavailable = {peer: why for peer in INSTALLED for _, why in [peer_python(peer)] if why}
    for peer, why in unavailable.items():
        ctx.log(f"{peer}: unavailable: {why.splitlines()[-1]}")

    # --- packing: dimd pack of the originals, then every format written from the same bytes
    packing: dict[str, list[dict]] = {}
    for r in range(p["runs"]):
        ctx.log(f"packing, run {r + 1}/{p['runs']}: dimd pack of the original tree")
        stem = work / "dimd-pack" / "train"
        stem.parent.mkdir(parents=True, exist_ok=True)
        doc = dimd_job(["pack", images, "-o", stem, "--workers", p["workers"], "--force", "--quiet"],
                       work / "runs" / f"dimd-pack_run{r}.json")
        packing.setdefault("dimd pack (resize + write)", []).append(doc["result"])
        if r == 0:
            write_manifest(stem, manifest)
        for label, peer in FORMATS:
            if peer in unavailable:
                continue
            ctx.log(f"packing, run {r + 1}/{p['runs']}: {label}")
            out = formats / peer
            if out.exists():
                shutil.rmtree(out)
            try:
                doc = peer_job(peer, "pack", ["--manifest", manifest, "--out", out, "--workers", p["workers"]],
                               work / "runs" / f"pack_{peer}_run{r}.json")
            except JobError as exc:
                unavailable[peer] = f"pack failed: {exc}"
                ctx.log(f"{peer}: {unavailable[peer]}")
                continue
            packing.setdefault(label, []).append(doc)
    expected = read_manifest(manifest)

    # --- every format's records against the tree
    verification: dict[str, Any] = {"tree": {"images": len(tree)}}
    verification["tree"]["packed_matches_tree"] = (
        [(r["name"], int(r["label"])) for r in expected] == [(t["name"], t["label"]) for t in tree])
    verification["tree"]["manifest_bytes_ok"] = all(
        zlib.crc32((manifest / "files" / r["name"]).read_bytes()) & 0xFFFFFFFF == int(r["crc32"])
        for r in expected)
    for label, peer in FORMATS:
        if peer in unavailable:
            continue
        tsv = work / "runs" / f"records_{peer}.tsv"
        try:
            doc = peer_job(peer, "verify", ["--manifest", manifest, "--data", formats / peer, "--records", tsv],
                           work / "runs" / f"verify_{peer}.json")
        except JobError as exc:
            verification[label] = {"ok": False, "error": str(exc)}
            continue
        verification[label] = {**check_records(tsv, expected),
                               **{k: v for k, v in doc.items() if k.startswith("pil_")}}
    if "torchvision" not in unavailable:
        tsv = work / "runs" / "records_torchvision_originals.tsv"
        try:
            peer_job("torchvision", "verify", ["--manifest", manifest, "--data", images, "--records", tsv],
                     work / "runs" / "verify_torchvision_originals.json")
            verification["ImageFolder, original files"] = check_records(
                tsv, [{**t, "crc32": 0, "length": 0} for t in tree], bytes_known=False)
        except JobError as exc:
            verification["ImageFolder, original files"] = {"ok": False, "error": str(exc)}
    bad = [k for k, v in verification.items() if k != "tree" and not v.get("ok")]
    if not verification["tree"]["packed_matches_tree"] or not verification["tree"]["manifest_bytes_ok"]:
        bad.append("tree")
    if bad:
        raise JobError(f"records do not match the tree for {', '.join(bad)}: "
                       f"{ {k: verification[k] for k in bad} }")

    # --- training batches, interleaved runs, a fresh process each
    loading: dict[str, list[dict]] = {}
    for r in range(p["runs"]):
        for label, peer, source in LOADERS:
            if peer in unavailable:
                continue
            ctx.log(f"loading, run {r + 1}/{p['runs']}: {label}")
            data = images if source == "originals" else formats / peer
            tag = label.split(",")[0].lower() + ("_originals" if source == "originals" else "")
            try:
                doc = peer_job(peer, "load", ["--manifest", manifest, "--data", data, "--workers", p["workers"],
                                              "--batch-size", p["batch_size"], "--image-size", p["image_size"],
                                              "--epochs", p["epochs"], "--warmup-epochs", p["warmup_epochs"],
                                              "--seed", p["seed"] + r],
                               work / "runs" / f"load_{tag}_run{r}.json")
            except JobError as exc:
                unavailable[peer] = f"load failed: {exc}"
                ctx.log(f"{peer}: {unavailable[peer]}")
                continue
            loading.setdefault(label, []).append(doc)

    return p, {"records": len(expected), "tree_images": len(tree),
               "packing": summarise_packing(packing), "loading": summarise_loading(loading),
               "verification": verification, "unavailable": unavailable}


def summarise_packing(packing: dict[str, list[dict]]) -> dict[str, Any]:
    rows = {}
    for label, docs in packing.items():
        images = [d.get("images", d.get("records")) for d in docs]
        rows[label] = {"seconds": spread(d["seconds"] for d in docs),
                       "cpu_seconds": spread(d["cpu_seconds"] for d in docs),
                       "images_per_s": spread(n / d["seconds"] for n, d in zip(images, docs)),
                       "images": images[0], "bytes": docs[-1].get("bytes", docs[-1].get("bytes_out")),
                       "processes": docs[-1].get("processes", docs[-1].get("workers")),
                       "versions": docs[-1].get("versions", {})}
    return rows


def summarise_loading(loading: dict[str, list[dict]]) -> dict[str, Any]:
    rows = {}
    for label, docs in loading.items():
        measured = [e for d in docs for e in d["epochs"] if not e["warmup"]]
        warmups = [e for d in docs for e in d["epochs"] if e["warmup"]]
        rows[label] = {"images_per_s": spread(e["images"] / e["seconds"] for e in measured),
                       "images_per_cpu_s": spread(e["images"] / max(e["cpu_seconds"], 1e-9) for e in measured),
                       "cores_busy": spread(e["cpu_seconds"] / e["seconds"] for e in measured),
                       "images_per_epoch": sorted({e["images"] for e in measured}),
                       "epoch_seconds": spread(e["seconds"] for e in measured),
                       "warmup_seconds": spread(e["seconds"] for e in warmups),
                       "how": docs[-1]["how"], "versions": docs[-1]["versions"]}
    return rows


# ---------------------------------------------------------------------------- the figure
def plot(envelope: dict[str, Any]):
    from dimd import plotting

    result = envelope["result"]
    loading, packing = result["loading"], result["packing"]
    fig, axes = plotting.figure(1, 3, width=4.4, height=4.6)
    labels = [label for label, _, _ in LOADERS]
    missing = {label for label, peer, _ in LOADERS if label not in loading}
    for ax, key, unit in ((axes[0][0], "images_per_s", "images/s (wall time)"),
                          (axes[0][1], "images_per_cpu_s", "images per CPU-second (all processes)")):
        for i, label in enumerate(labels):
            if label in missing:
                ax.text(i, 0, "unavailable", rotation=90, ha="center", va="bottom", fontsize=7, color="#777777")
                continue
            plotting.bars(ax, [i], [loading[label][key]], width=0.7, label=None,
                          color_=COLOURS.get(label, "#999999"))
            ax.annotate(f"{loading[label][key]['median']:.0f}", (i, loading[label][key]["max"]), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        if BASELINE in loading:
            plotting.baseline_level(ax, loading[BASELINE][key]["median"], "ImageFolder over the original files")
            ax.legend(loc="upper right", fontsize=7)
        ax.set_xticks(range(len(labels)), [label.replace(", ", ",\n") for label in labels], rotation=35,
                      ha="right", fontsize=7.5)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
    p = envelope["parameters"]
    axes[0][0].set_title(f"training batches: {p['batch_size']} x 3 x {p['image_size']}^2 uint8, "
                         f"{p['workers']} workers", fontsize=9)
    axes[0][1].set_title("the same, per CPU-second", fontsize=9)
    ax = axes[0][2]
    pack_labels = ["dimd pack (resize + write)"] + [label for label, _ in FORMATS]
    for i, label in enumerate(pack_labels):
        if label not in packing:
            ax.text(i, 0, "unavailable", rotation=90, ha="center", va="bottom", fontsize=7, color="#777777")
            continue
        plotting.bars(ax, [i], [packing[label]["seconds"]], width=0.7, label=None,
                      color_=COLOURS.get(label, COLOURS.get(label.split(" ")[0], "#999999")),
                      hatch="//" if label.startswith("dimd pack") else None)
        seconds = packing[label]["seconds"]["median"]
        ax.annotate(f"{seconds:.1f}" if seconds >= 1 else f"{seconds:.2g}", (i, packing[label]["seconds"]["max"]),
                    ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(pack_labels)), [label.replace(" (", "\n(") for label in pack_labels], rotation=35,
                  ha="right", fontsize=7.5)
    ax.set_ylabel("seconds (wall, log scale)")
    ax.set_yscale("log")
    shown = [packing[label]["seconds"]["min"] for label in pack_labels if label in packing]
    if shown:
        ax.set_ylim(bottom=max(min(shown) / 3, 1e-3))
    ax.set_title(f"packing {result['records']} images: resize once,\nthen write the same JPEGs into each format",
                 fontsize=9)
    return fig


def findings(envelope: dict[str, Any]) -> str:
    result, p = envelope["result"], envelope["parameters"]
    loading, packing = result["loading"], result["packing"]
    lines = [f"{result['records']} images ({p['classes']} classes, `dimd sample-data` at ImageNet-like sizes, "
             f"packed to short side 256), batches of {p['batch_size']}, random-resized crop to "
             f"{p['image_size']} px + flip, uint8, {p['workers']} workers each; one warm-up epoch, then one "
             f"measured epoch per run, medians of {p['runs']} runs (min-max in brackets); images counted as "
             f"delivered in batches."]
    if loading:
        base = loading.get(BASELINE)
        cells = []
        for label, _, _ in LOADERS:
            if label not in loading:
                continue
            row = loading[label]
            rate, cpu = row["images_per_s"], row["images_per_cpu_s"]
            cell = (f"{label} {rate['median']:.0f} images/s ({rate['min']:.0f}-{rate['max']:.0f}), "
                    f"{cpu['median']:.0f} per CPU-s, {row['cores_busy']['median']:.1f} cores busy")
            if base and label != BASELINE:
                cell += f", {rate['median'] / base['images_per_s']['median']:.1f}x the baseline"
            cells.append(cell)
        lines.append("**Training batches:** " + "; ".join(cells) + ".")
        busy = [row["cores_busy"]["median"] for row in loading.values()]
        if max(busy) < 0.5 * p["workers"]:
            lines.append(f"The loaders kept only {min(busy):.1f}-{max(busy):.1f} of the {p['workers']} cores busy "
                         f"on average: other jobs had the rest, so the wall-time rates say more about the "
                         f"machine's load than about the loaders; images per CPU-second (user + system time "
                         f"of every thread and worker process) compare them.")
    if packing:
        cells = []
        for label, row in packing.items():
            cells.append(f"{label} {row['seconds']['median']:.1f} s ({row['cpu_seconds']['median']:.1f} CPU-s, "
                         f"{row['processes']} process{'es' if row['processes'] != 1 else ''}, "
                         f"{row['bytes'] / 2**20:.0f} MiB)")
        lines.append("**Packing:** " + "; ".join(cells) + ". Only `dimd pack` decodes and resizes; every other "
                     "figure is the time to write the same JPEG bytes into the format (a peer's user also "
                     "has to resize first, which is what `dimd pack` spends its time on). FFCV's and litdata's "
                     "times include starting their writer processes (litdata spawns them, and each imports "
                     "torch afresh).")
    checks = [f"{k} {'ok' if v.get('ok') else 'FAILED'} ({v.get('checked', v.get('error', ''))})"
              for k, v in result["verification"].items() if k != "tree"]
    tv = result["verification"].get("files (ImageFolder)", {})
    lines.append(f"**Records checked against the tree** ({result['tree_images']} images): " + "; ".join(checks)
                 + "." + (f" The Pillow augmentation the litdata and webdataset peers use differs from "
                          f"torchvision's `resized_crop` by at most "
                          f"{tv['pil_augmentation_max_difference_from_torchvision']} (of 255)."
                          if "pil_augmentation_max_difference_from_torchvision" in tv else ""))
    differs = ["| loader | workers | where the bytes are | shuffle | decode | last batch |",
               "|---|---|---|---|---|---|"]
    for label, _, _ in LOADERS:
        if label in loading:
            how = loading[label]["how"]
            differs.append(f"| {label} | {how['workers']} | {how['storage']} | {how['shuffle']} | {how['decode']} | "
                           f"{how['last_batch']} |")
    if len(differs) > 2:
        lines.append("**What still differs** (everything fits in memory, so every peer reads from the page cache; "
                     "on a cluster's shared file system they would read over the network, dimd once):\n\n"
                     + "\n".join(differs))
    for peer, why in result.get("unavailable", {}).items():
        first, last = why.splitlines()[0], why.splitlines()[-1].strip()
        lines.append(f"**{peer} unavailable:** {first}" + (f" `{last}`" if last != first else ""))
    return "\n\n".join(lines)


REPRODUCTION = Reproduction(
    name="peer_loaders",
    title="dimd against the loaders users would pick instead: FFCV, litdata, webdataset, ImageFolder",
    claim=("The papers compare dimd's in-memory batches with reading files from a shared file system "
           "(DIMD section 4.1). A user today would pick one of the packed-format loaders instead: FFCV "
           "(a memory-mapped .beton with JIT-compiled decoding), litdata (chunked streaming), webdataset "
           "(tar shards), or plain torchvision `ImageFolder` + `DataLoader` over the files. Here: the same "
           "short-side-256 JPEGs in every format, the same augmentation, the same worker count."),
    measure=measure, plot=plot, findings=findings, minutes=12.0, default=False)
