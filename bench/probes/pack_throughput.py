#!/usr/bin/env python
"""Benchmark `dimd pack` against the loop a user would write, on an ImageNet-like image set.

What is measured, in one run and one environment, interleaved so that noise
on a shared machine hits every method alike:

* naive:  for each file, Pillow open -> convert("RGB") -> resize(BICUBIC) to
          short side 256 -> save JPEG quality 90 -> append to one file;
* dimd pack --workers 1 and --workers 2 (the real command in a subprocess;
  its own --json "seconds" are used, so interpreter start-up is not counted).

It prints images/s (median of --repeats runs, with min and max), the ratios
dimd/naive (1 worker) and 2 workers/1 worker, and output quality: PSNR of
dimd's images against the naive loop's, and of both against a reference
(full decode, LANCZOS resize, no re-encoding). --json PATH writes it all.

    .venv/bin/python bench/probes/pack_throughput.py --images 400 --repeats 3 --json pack-bench.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SHORT_SIDE, QUALITY = 256, 90


# --- the data set -----------------------------------------------------------------------------

def image_size(rng: np.random.Generator, large_share: float) -> tuple[int, int]:
    """Most images 300-640 px (like ImageNet's typical 500x375), a share 1000-3000 px."""
    if rng.random() < large_share:
        long_side = int(rng.integers(1000, 3001))
        short_side = max(1000, int(long_side * rng.uniform(0.66, 1.0)))
    else:
        long_side = int(rng.integers(400, 641))
        short_side = max(300, int(long_side * rng.uniform(0.66, 1.0)))
    return (long_side, short_side) if rng.random() < 0.75 else (short_side, long_side)


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Multi-octave smooth noise plus shapes, edges and grain: JPEG-wise close to a photo."""
    image = np.zeros((height, width, 3), np.float32)
    for octave, weight in ((4, 90.0), (16, 45.0), (64, 20.0)):
        small = rng.normal(0, 1, (octave * height // width + 2, octave + 2, 3)).astype(np.float32)
        layer = Image.fromarray(np.uint8(np.clip(128 + 40 * small, 0, 255)), "RGB")
        image += (np.asarray(layer.resize((width, height), Image.Resampling.BICUBIC), np.float32)
                  - 128) * (weight / 40)
    image += rng.uniform(60, 190, 3)
    image += rng.normal(0, 5, (height, width, 1)).astype(np.float32)  # sensor grain
    picture = Image.fromarray(np.uint8(np.clip(image, 0, 255)), "RGB")
    draw = ImageDraw.Draw(picture)
    for _ in range(int(rng.integers(3, 9))):
        x0, x1 = sorted(rng.uniform(0, width, 2))
        y0, y1 = sorted(rng.uniform(0, height, 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=colour)
    return picture.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.6, 1.4))))


def _make_one(job: tuple) -> int:
    path, seed, index, large_share = job
    rng = np.random.default_rng([seed, index])
    width, height = image_size(rng, large_share)
    photo_like(rng, width, height).save(path, "JPEG", quality=int(rng.integers(85, 96)))
    return os.path.getsize(path)


def make_dataset(root: Path, images: int, classes: int, seed: int, large_share: float) -> int:
    """An ImageNet-style class tree; reused when it already holds the requested images."""
    jobs = []
    for i in range(images):
        folder = root / f"n{i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((str(folder / f"img_{i:06d}.JPEG"), seed, i, large_share))
    missing = [job for job in jobs if not os.path.exists(job[0])]
    if missing:
        with ProcessPoolExecutor(os.cpu_count()) as pool:
            list(pool.map(_make_one, missing, chunksize=4))
    return sum(os.path.getsize(job[0]) for job in jobs)


def tree_files(root: Path) -> list[Path]:
    return [p for d in sorted(root.iterdir()) for p in sorted(d.iterdir())]


# --- the methods --------------------------------------------------------------------------------

def naive_target(width: int, height: int) -> tuple[int, int]:
    if width <= height:
        return SHORT_SIDE, round(height * SHORT_SIDE / width)
    return round(width * SHORT_SIDE / height), SHORT_SIDE


def naive_encode(path: Path) -> bytes:
    """What a user would write per image: open, convert, BICUBIC resize, save quality 90."""
    image = Image.open(path).convert("RGB")
    image = image.resize(naive_target(*image.size), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def naive_pack(files: list[Path], out: Path) -> tuple[float, float]:
    """The loop a user would write; returns (seconds, CPU seconds)."""
    start, cpu = time.perf_counter(), time.process_time()
    with open(out, "wb") as sink:
        for path in files:
            sink.write(naive_encode(path))
    return time.perf_counter() - start, time.process_time() - cpu


def naive_images(files: list[Path]) -> list[bytes]:
    return [naive_encode(path) for path in files]


def dimd_pack(root: Path, out: Path, workers: int) -> tuple[float, float]:
    """`dimd pack` as a user runs it; returns the (seconds, CPU seconds) it reports.

    Both exclude interpreter start-up; CPU seconds include the worker processes.
    """
    summary = out.with_suffix(".json")
    subprocess.run([sys.executable, "-m", "dimd", "pack", str(root), "-o", str(out), "--force",
                    "--quiet", "--workers", str(workers), "--json", str(summary)],
                   check=True, capture_output=True, text=True)
    doc = json.loads(summary.read_text())["result"]
    return float(doc["seconds"]), float(doc["cpu_seconds"])


# --- quality --------------------------------------------------------------------------------------

def mse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))


def psnr(mean_squared_error: float) -> float:
    """Over a set: from the mean of the per-image MSEs (identical images would make a mean of PSNRs inf)."""
    return float("inf") if mean_squared_error == 0 else float(10 * np.log10(255.0**2 / mean_squared_error))


def decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def quality_report(files: list[Path], packed_stem: Path) -> dict:
    from dimd.format import PackedDataset

    ds = PackedDataset(packed_stem)
    naive = naive_images(files)
    by_name = {name: i for i, name in enumerate(ds.names)}
    vs_naive, dimd_vs_ref, naive_vs_ref = [], [], []
    for path, naive_bytes in zip(files, naive):
        ours = decode(bytes(ds.record(by_name[f"{path.parent.name}/{path.name}"])))
        theirs = decode(naive_bytes)
        source = Image.open(path).convert("RGB")
        reference = np.asarray(source.resize(naive_target(*source.size), Image.Resampling.LANCZOS))
        if ours.shape != theirs.shape:
            raise SystemExit(f"{path}: dimd stored {ours.shape}, the naive loop {theirs.shape}")
        vs_naive.append(mse(ours, theirs))
        dimd_vs_ref.append(mse(ours, reference))
        naive_vs_ref.append(mse(theirs, reference))
    return {"psnr_dimd_vs_naive_db": round(psnr(statistics.mean(vs_naive)), 2),
            "psnr_dimd_vs_naive_min_db": round(psnr(max(vs_naive)), 2),
            "psnr_dimd_vs_reference_db": round(psnr(statistics.mean(dimd_vs_ref)), 2),
            "psnr_naive_vs_reference_db": round(psnr(statistics.mean(naive_vs_ref)), 2),
            "bytes_dimd": ds.data_bytes, "bytes_naive": sum(map(len, naive))}


# --- main ---------------------------------------------------------------------------------------

def rates(runs: list[tuple[float, float]], images: int) -> dict:
    """images/s and images per CPU-second over the repeats (dimd.report.spread), and the raw times."""
    from dimd.report import spread

    return {"images_per_s": spread(images / wall for wall, _ in runs),
            "images_per_cpu_s": spread(images / cpu for _, cpu in runs),
            "seconds": [round(wall, 3) for wall, _ in runs],
            "cpu_seconds": [round(cpu, 3) for _, cpu in runs]}


def main(argv: list[str] | None = None) -> int:
    work = Path(tempfile.mkdtemp(prefix="dimd-pack-bench-"))
    try:
        return run(argv, work)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)  # the outputs, and the images unless --data kept them


def run(argv: list[str] | None, work: Path) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=400, help="images in the generated set")
    parser.add_argument("--classes", type=int, default=20)
    parser.add_argument("--large-share", type=float, default=0.15, help="share of 1000-3000 px images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per method (median reported)")
    parser.add_argument("--data", type=Path, help="where to generate (and reuse) the image set")
    parser.add_argument("--json", type=Path, help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (medians of fewer runs mean little here)")

    import PIL

    from dimd.report import result_document, write_json

    root = args.data or work / "images"
    print(f"generating {args.images} images in {root} ...", file=sys.stderr)
    bytes_in = make_dataset(root, args.images, args.classes, args.seed, args.large_share)
    files = tree_files(root)
    sizes = [Image.open(p).size for p in files]
    large = sum(max(s) >= 1000 for s in sizes)
    print(f"{len(files)} images, {bytes_in / 2**20:.1f} MiB, {large} of them >= 1000 px",
          file=sys.stderr)

    for path in files:  # warm the page cache, so every method reads from memory
        path.read_bytes()
    times: dict[str, list[tuple[float, float]]] = {"naive": [], "dimd_w1": [], "dimd_w2": []}
    for repeat in range(args.repeats):
        times["naive"].append(naive_pack(files, work / "naive.bin"))
        times["dimd_w1"].append(dimd_pack(root, work / "w1", 1))
        times["dimd_w2"].append(dimd_pack(root, work / "w2", 2))
        print(f"run {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{k} {len(files) / v[-1][0]:.1f} img/s" for k, v in times.items()), file=sys.stderr)
    identical = (work / "w1.dimd").read_bytes() == (work / "w2.dimd").read_bytes()
    quality = quality_report(files, work / "w1")

    methods = {k: rates(v, len(files)) for k, v in times.items()}
    median = {k: statistics.median(wall for wall, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    figures = {
        "images": len(files), "large_images": large, "bytes_in": bytes_in,
        "cores": os.cpu_count(), "pillow": PIL.__version__,
        "methods": methods,
        "speedup_dimd_w1_vs_naive": round(median["naive"] / median["dimd_w1"], 2),
        "speedup_w2_vs_w1": round(median["dimd_w1"] / median["dimd_w2"], 2),
        "speedup_dimd_w2_vs_naive": round(median["naive"] / median["dimd_w2"], 2),
        # CPU time is what a busy shared machine cannot distort; w2 vs w1 in CPU time shows
        # the parallel overhead (1.0 = none), wall time shows the speed-up the cores allowed.
        "cpu_speedup_dimd_w1_vs_naive": round(cpu["naive"] / cpu["dimd_w1"], 2),
        "cpu_efficiency_w2_vs_w1": round(cpu["dimd_w1"] / cpu["dimd_w2"], 2),
        "load_average": os.getloadavg(),
        "w1_w2_byte_identical": identical,
        "quality": quality,
    }
    print(f"\n{'method':<22}{'images/s (median)':>18}{'min':>9}{'max':>9}{'images/CPU-s':>14}")
    for name, label in (("naive", "naive Pillow loop"), ("dimd_w1", "dimd pack --workers 1"),
                        ("dimd_w2", "dimd pack --workers 2")):
        r = methods[name]["images_per_s"]
        print(f"{label:<22}{r['median']:>18.1f}{r['min']:>9.1f}{r['max']:>9.1f}"
              f"{methods[name]['images_per_cpu_s']['median']:>14.1f}")
    print(f"\ndimd --workers 1 vs naive loop: {figures['speedup_dimd_w1_vs_naive']:.2f}x")
    print(f"dimd --workers 2 vs --workers 1: {figures['speedup_w2_vs_w1']:.2f}x")
    print(f"dimd --workers 2 vs naive loop: {figures['speedup_dimd_w2_vs_naive']:.2f}x")
    print(f"in CPU time: dimd --workers 1 vs naive {figures['cpu_speedup_dimd_w1_vs_naive']:.2f}x; "
          f"--workers 2 uses {1 / figures['cpu_efficiency_w2_vs_w1']:.2f}x the CPU of --workers 1 "
          f"(load average {figures['load_average'][0]:.1f} on {os.cpu_count()} cores)")
    print(f"--workers 1 and 2 outputs byte-identical: {identical}")
    print(f"PSNR dimd vs naive: {quality['psnr_dimd_vs_naive_db']:.2f} dB (worst image "
          f"{quality['psnr_dimd_vs_naive_min_db']:.2f}); vs reference (full decode, LANCZOS): "
          f"dimd {quality['psnr_dimd_vs_reference_db']:.2f} dB, naive "
          f"{quality['psnr_naive_vs_reference_db']:.2f} dB")
    if args.json:
        params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        write_json(args.json, result_document("bench/probes/pack_throughput.py", params, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
