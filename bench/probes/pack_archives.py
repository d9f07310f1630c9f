#!/usr/bin/env python
"""Benchmark `dimd pack` from archives against packing the same images from their extracted tree.

Each measurement runs side by side with its baseline in one run, repeated and
interleaved so that noise on a shared machine hits both alike; medians of
--repeats runs, with min and max:

1. local disk: a tar of per-class tars against its tree, images/s, with the
   files in the page cache ("warm") and with their cached pages dropped before
   each run (posix_fadvise DONTNEED on this benchmark's files only, "cold");
   WebDataset shards and Parquet files of the same images are timed in the
   warm loop too, and must give the tree's records (same bytes, same order,
   given the tree's class order);
2. a slow network file system: the same tar and tree on an sshfs mount
   (bench/netfs.sh, each of --rtt-ms added to every round trip), a fresh
   mount for each run, images/s;
3. memory: a tar of at least --memory-gib GiB against its tree, the peak
   resident memory of the pack (the command and its workers, RSS and PSS
   summed over the processes, sampled every 50 ms).

The images come from `dimd sample-data`: --distinct images, each copied
(with a few bytes after its end, so every file is its own) until the set has
--images images (or --memory-gib GiB of 1000-3000 px images for 3). The
archives are written with Python's tarfile and pyarrow (bench/probes/archive_copies.py).
The speed ratio is the tar's images/s over the tree's: above 1, the tar is faster.

    .venv/bin/python bench/probes/pack_archives.py --json bench/probes/results/pack_archives.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from statistics import median

import archive_copies

BENCH = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- data
def sample_set(root: Path, classes: int, distinct: int, large_share: float, seed: int, *,
               images: int = 0, min_bytes: int = 0) -> Path:
    """``distinct`` images from `dimd sample-data` in ``classes`` class folders, then copies of them until
    the set has ``images`` images and ``min_bytes`` bytes."""
    from dimd.sample_data import SampleSpec, generate

    base = root.with_name(root.name + "-distinct")
    if not base.exists():
        generate(SampleSpec(root=base, classes=classes, per_class=-(-distinct // classes), seed=seed,
                            large_share=large_share), workers=os.cpu_count())
    originals = [p for _, files in archive_copies.tree_files(base) for p in files]
    root.mkdir(parents=True)
    count = written = 0
    while count < images or written < min_bytes:
        source = originals[count % len(originals)]
        copy = count // len(originals)
        folder = root / source.parent.name
        folder.mkdir(exist_ok=True)
        name = source.name if copy == 0 else f"{source.stem}-{copy:04d}{source.suffix}"
        # bytes after the JPEG's end: ignored by every decoder, so each copy is a file of its own
        data = source.read_bytes() + b"copy %d" % copy
        (folder / name).write_bytes(data)
        count, written = count + 1, written + len(data)
    return root


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def drop_cached_pages(paths: list[Path]) -> None:
    """Evict these files' pages from the page cache (theirs only: other users' cached data stays)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------- running dimd pack
def dimd_pack(src: list[str], out: Path, workers: int, extra: list[str] = (), *, wrap: list[str] = (),
              sample_memory: bool = False) -> dict:
    """``dimd pack`` as a user runs it; its --json summary, with the peak memory when asked."""
    summary = out.with_suffix(".json")
    command = [*map(str, wrap), sys.executable, "-m", "dimd", "pack", *map(str, src), "-o", str(out), "--force",
               "--quiet", "--workers", str(workers), "--json", str(summary), *map(str, extra)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = _MemoryPeak(proc.pid) if sample_memory else None
    stdout, stderr = proc.communicate()
    if peak is not None:
        peak.stop()
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(command)}\n{stdout}\n{stderr}")
    doc = json.loads(summary.read_text())["result"]
    if peak is not None:
        doc["peak_rss_bytes"], doc["peak_pss_bytes"] = peak.rss, peak.pss
    return doc


class _MemoryPeak:
    """The largest sum of RSS (and PSS) over a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid, self.every_s, self.rss, self.pss = pid, every_s, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            rss = pss = 0
            for pid in _family(self.pid):
                rss += _kib(f"/proc/{pid}/status", "VmRSS:")
                pss += _kib(f"/proc/{pid}/smaps_rollup", "Pss:")
            self.rss, self.pss = max(self.rss, rss * 1024), max(self.pss, pss * 1024)
            self._done.wait(self.every_s)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _family(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(parents.get(pid, []))
    return found


def _kib(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def same_records(a: Path, b: Path) -> bool:
    """The same data file and the same index rows (offsets, lengths, labels, crc32s, sizes) and classes."""
    import numpy as np

    from dimd.format import PackedDataset

    first, second = PackedDataset(a), PackedDataset(b)
    return (first.data_path.read_bytes() == second.data_path.read_bytes()
            and bool(np.array_equal(first.records, second.records)) and first.classes == second.classes)


def images_per_s(docs: list[dict]) -> dict:
    from dimd.report import spread

    return spread(d["images"] / d["seconds"] for d in docs)


def ratio(faster: list[dict], baseline: list[dict]) -> float:
    return round(images_per_s(faster)["median"] / images_per_s(baseline)["median"], 3)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the measurements
def local_disk(work: Path, tree: Path, args) -> dict:
    tar = archive_copies.write_nested_tar(tree, work / "train.tar")
    classes = work / "classes.txt"
    classes.write_text("".join(f"{name}\n" for name, _ in archive_copies.tree_files(tree)))
    shards = archive_copies.write_webdataset(tree, work / "shards", per_shard=args.per_shard)
    parquet = archive_copies.write_parquet(tree, work / "parquet", files=len(shards), class_label=True,
                                           row_group_rows=64)
    files = [p for p in tree.rglob("*") if p.is_file()]
    ways = {"tree": ([tree], []), "tar": ([tar], []), "webdataset": (shards, ["--classes-file", classes]),
            "parquet": (parquet, [])}
    runs: dict[str, list[dict]] = {f"{way}_warm": [] for way in ways} | {"tree_cold": [], "tar_cold": []}
    for path in [*files, tar, *shards, *parquet]:  # warm: every way reads from the page cache
        path.read_bytes()
    for repeat in range(args.repeats):
        for way, (src, extra) in ways.items():
            runs[f"{way}_warm"].append(dimd_pack(src, work / f"out-{way}", args.workers, extra))
        for way, cached in (("tree", files), ("tar", [tar])):
            drop_cached_pages(cached)
            runs[f"{way}_cold"].append(dimd_pack(ways[way][0], work / f"out-{way}-cold", args.workers))
        log(f"local run {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{k} {v[-1]['images'] / v[-1]['seconds']:.0f} img/s" for k, v in runs.items()))
    identical = {way: same_records(work / "out-tree", work / f"out-{way}") for way in ways if way != "tree"}
    return {"images": runs["tree_warm"][0]["images"], "bytes_in": tree_bytes(tree),
            "tar_bytes": tar.stat().st_size, "shards": len(shards), "parquet_files": len(parquet),
            "images_per_s": {k: images_per_s(v) for k, v in runs.items()},
            "cpu_seconds": {k: [d["cpu_seconds"] for d in v] for k, v in runs.items()},
            "ratio_tar_vs_tree_warm": ratio(runs["tar_warm"], runs["tree_warm"]),
            "ratio_tar_vs_tree_cold": ratio(runs["tar_cold"], runs["tree_cold"]),
            # images per CPU-second (the command and its workers): what a busy machine leaves of the speed
            "ratio_cpu_tar_vs_tree_warm": round(median(d["images"] / d["cpu_seconds"] for d in runs["tar_warm"])
                                                / median(d["images"] / d["cpu_seconds"] for d in runs["tree_warm"]), 3),
            "ratio_webdataset_vs_tree_warm": ratio(runs["webdataset_warm"], runs["tree_warm"]),
            "ratio_parquet_vs_tree_warm": ratio(runs["parquet_warm"], runs["tree_warm"]),
            "same_records_as_tree": identical}


def network_fs(work: Path, tree: Path, args) -> dict:
    """The tree and the tar exported over sshfs with each round trip of --rtt-ms; a fresh mount for each run."""
    export = work / "export"
    export.mkdir()
    shutil.move(str(tree), export / "tree")
    archive_copies.write_nested_tar(export / "tree", export / "train.tar")
    mount = work / "mnt"
    runs: dict[tuple[float, str], list[dict]] = {(rtt, way): [] for rtt in args.rtt_ms for way in ("tree", "tar")}
    measured: dict[float, dict] = {}
    for repeat in range(args.repeats):
        for rtt in args.rtt_ms:
            for way, src in (("tree", mount / "tree"), ("tar", mount / "train.tar")):
                info = work / f"netfs-{rtt:g}.json"
                wrap = [BENCH / "netfs.sh", "run", "--export", export, "--mount", mount, "--rtt-ms", rtt,
                        "--info", info, "--"]
                runs[rtt, way].append(dimd_pack([src], work / f"net-{way}", args.workers, wrap=wrap))
                measured[rtt] = json.loads(info.read_text())
        log(f"sshfs run {repeat + 1}/{args.repeats}: " + ", ".join(
            f"+{rtt:g} ms {way} {v[-1]['images'] / v[-1]['seconds']:.0f} img/s" for (rtt, way), v in runs.items()))
    return {f"{rtt:g}": {"netfs": measured[rtt], "images": runs[rtt, "tree"][0]["images"],
                         "images_per_s": {way: images_per_s(runs[rtt, way]) for way in ("tree", "tar")},
                         "cpu_seconds": {way: [d["cpu_seconds"] for d in runs[rtt, way]] for way in ("tree", "tar")},
                         "ratio_tar_vs_tree": ratio(runs[rtt, "tar"], runs[rtt, "tree"])}
            for rtt in args.rtt_ms}


def memory(work: Path, args) -> dict:
    tree = sample_set(work / "big", args.classes, args.memory_distinct, 1.0, args.seed + 1,
                      min_bytes=int(args.memory_gib * (1 << 30)))
    tar = archive_copies.write_nested_tar(tree, work / "big.tar")
    runs: dict[str, list[dict]] = {"tree": [], "tar": []}
    for repeat in range(args.repeats):
        for way, src in (("tree", tree), ("tar", tar)):
            runs[way].append(dimd_pack([src], work / f"mem-{way}", args.workers, sample_memory=True))
        log(f"memory run {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{k} {v[-1]['peak_rss_bytes'] / 2**20:.0f} MiB RSS" for k, v in runs.items()))
    from dimd.report import spread

    rss = {k: spread(d["peak_rss_bytes"] for d in v) for k, v in runs.items()}
    pss = {k: spread(d["peak_pss_bytes"] for d in v) for k, v in runs.items()}
    return {"tar_bytes": tar.stat().st_size, "images": runs["tree"][0]["images"],
            "peak_rss_bytes": rss, "peak_pss_bytes": pss,
            "ratio_rss_tar_vs_tree": round(rss["tar"]["median"] / rss["tree"]["median"], 3),
            "ratio_pss_tar_vs_tree": round(pss["tar"]["median"] / pss["tree"]["median"], 3),
            "images_per_s": {k: images_per_s(v) for k, v in runs.items()}}


def netfs_problem() -> str | None:
    if os.geteuid() != 0:
        return "not root (sshd and FUSE need it)"
    if not (shutil.which("sshfs") and (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd"))):
        return "sshd or sshfs missing (make netfs-setup)"
    return None if os.path.exists("/dev/fuse") else "no /dev/fuse"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000, help="images of the speed set")
    parser.add_argument("--distinct", type=int, default=400, help="of which generated (the rest are copies)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-shard", type=int, default=250, help="WebDataset samples per shard")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way (median reported)")
    parser.add_argument("--rtt-ms", type=lambda text: [float(v) for v in text.split(",")], default=[2.0, 10.0],
                        help="round trips added to the sshfs mount, comma-separated (default: 2,10)")
    parser.add_argument("--memory-gib", type=float, default=2.0, help="size of the tar for the memory measurement")
    parser.add_argument("--memory-distinct", type=int, default=100, help="distinct images of the memory set")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", choices=("local", "netfs", "memory"), action="append",
                        help="run only these measurements (repeatable; default: all)")
    parser.add_argument("--work", type=Path, help="where to write the sets (default: a temporary folder, removed)")
    parser.add_argument("--json", type=Path, help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (medians of fewer runs mean little here)")
    only = set(args.only or ("local", "netfs", "memory"))
    work = args.work or Path(tempfile.mkdtemp(prefix="dimd-pack-archives-"))
    work.mkdir(parents=True, exist_ok=True)
    from dimd.report import result_document, write_json

    figures: dict = {"cores": os.cpu_count(), "workers": args.workers}
    try:
        if only & {"local", "netfs"}:
            log(f"generating {args.images} images ({args.distinct} distinct) ...")
            tree = sample_set(work / "train", args.classes, args.distinct, 0.15, args.seed, images=args.images)
        if "local" in only:
            figures["local"] = local_disk(work, tree, args)
        if "netfs" in only:
            problem = netfs_problem()
            figures["netfs"] = {"skipped": problem} if problem else network_fs(work, tree, args)
        if "memory" in only:
            figures["memory"] = memory(work, args)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    for part, key in (("local", "ratio_tar_vs_tree_warm"), ("local", "ratio_tar_vs_tree_cold"),
                      ("local", "ratio_cpu_tar_vs_tree_warm"),
                      ("local", "ratio_webdataset_vs_tree_warm"), ("local", "ratio_parquet_vs_tree_warm"),
                      ("local", "same_records_as_tree"),
                      ("memory", "ratio_rss_tar_vs_tree"), ("memory", "ratio_pss_tar_vs_tree")):
        if key in figures.get(part, {}):
            print(f"{part:7} {key:32} {figures[part][key]}")
    for rtt, netfs in figures.get("netfs", {}).items():
        if isinstance(netfs, dict) and "ratio_tar_vs_tree" in netfs:
            print(f"netfs   ratio_tar_vs_tree (+{rtt} ms)      {netfs['ratio_tar_vs_tree']}")
    if args.json:
        write_json(args.json, result_document("bench pack_archives", vars(args), figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
