#!/usr/bin/env python3
"""CPU per image of the loader's training decode at each crop size: what progressive resizing saves the loader.

The same records and the same random-resized crops (one set of draws per run)
are decoded by :func:`dimd.shuffle.decode.crop_hwc`, as the workers run it (the
region decoder where it serves), at each size, in one process and one thread,
timed by this process's CPU time. The order of the sizes turns round run by
run; each size's time is divided by the largest size's within the run, and the
medians over the runs are reported with min, max and every run
(``dimd.report.spread``), beside the ratio of the pixels. ``/proc/loadavg`` is
recorded before each run: the machine may be shared.

    python bench/probes/decode_by_size.py TRAIN_STEM --sizes 128 160 192 224 --runs 3 --json build/decode_by_size.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def decode_all(records: list[bytes], crops: list[tuple], size: int) -> float:
    """CPU seconds per image to decode every record's crop at ``size`` px."""
    from dimd.shuffle.decode import crop_hwc

    start = time.process_time()
    for data, (tries, position) in zip(records, crops):
        crop_hwc(data, size, tries, position)
    return (time.process_time() - start) / len(records)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from dimd.format import PackedDataset
    from dimd.report import spread
    from dimd.shuffle import decode
    from dimd.shuffle.crop import draw_crops

    packed = PackedDataset(args.train)
    count = min(args.images, len(packed.names))
    records = [bytes(packed.record(i)) for i in range(count)]
    sizes = sorted(args.sizes)
    largest = sizes[-1]
    runs = []
    for run in range(args.runs):
        draws = draw_crops(np.random.default_rng(run), count)
        crops = [draws.row(i)[:2] for i in range(count)]
        decode_all(records[: min(count, 20)], crops, largest)   # warm the decoder and the caches
        load = load_average()
        order = sizes[run % len(sizes):] + sizes[: run % len(sizes)]
        seconds = {size: decode_all(records, crops, size) for size in order}
        runs.append({"load_average": load, "us": {size: 1e6 * seconds[size] for size in sizes},
                     "ratio": {size: seconds[size] / seconds[largest] for size in sizes}})
        print(f"run {run + 1}/{args.runs} (load {load}): " + ", ".join(
            f"{size} px {runs[-1]['us'][size]:.0f} µs" for size in sizes), file=sys.stderr)
    figures = {size: {"us": spread(r["us"][size] for r in runs), "ratio": spread(r["ratio"][size] for r in runs),
                      "pixel_ratio": size * size / (largest * largest)} for size in sizes}
    return {"images": count, "region_decoder": decode._jpeg_region is not None,
            "load_averages": [r["load_average"] for r in runs], "sizes": figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train", type=Path, help="a packed set (the stem dimd pack wrote)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 160, 192, 224])
    parser.add_argument("--images", type=int, default=400, help="records per run (the first N)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    document = measure(args)
    largest = max(args.sizes)
    for size, figures in document["sizes"].items():
        print(f"{size} px: {figures['us']['median']:.0f} µs per image (median of {args.runs}), "
              f"{figures['ratio']['median']:.2f}x the {largest} px time ({figures['ratio']['min']:.2f}-"
              f"{figures['ratio']['max']:.2f}) for {figures['pixel_ratio']:.2f}x its pixels")
    print(f"load averages (1, 5, 15 min) before each run: {'; '.join(document['load_averages'])}")
    if args.json is not None:
        from dimd.report import result_document, write_json

        write_json(args.json, result_document("bench/probes/decode_by_size.py",
                                              {**vars(args), "train": str(args.train), "json": str(args.json)},
                                              document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
