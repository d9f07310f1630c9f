#!/usr/bin/env python3
"""CPU per image of the loader's decode: only the crop's region (libjpeg-turbo) against Pillow's full decode.

The same records, the same crops (one generator per run, the same draws for both ways), in one
process, one thread: ``region`` is :func:`dimd.shuffle.decode.crop_hwc` as the workers run it,
``full`` the same call with the region decoder switched off (Pillow's full decode of the image at
its draft scale, then the same crop and resize). Both ways are timed by this process's CPU time,
interleaved run by run; the ratio full / region is taken within each run, and the medians are
reported with min, max and every run (``dimd.report.spread``, as dimd reports repeated measurements).
The crops are asserted equal to the bit on every image, so the speed is all that differs.

    python bench/probes/region_decode.py TRAIN_STEM --image-size 224 --runs 5 --json build/region_decode.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def one_way(records: list[bytes], crops: list[tuple], size: int, evaluation: bool) -> tuple[float, list]:
    from dimd.shuffle.decode import crop_hwc, eval_hwc

    out = []
    start = time.process_time()
    for data, (tries, position) in zip(records, crops):
        out.append(eval_hwc(data, size) if evaluation else crop_hwc(data, size, tries, position))
    return (time.process_time() - start) / len(records), out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from dimd.format import PackedDataset
    from dimd.report import spread
    from dimd.shuffle import decode
    from dimd.shuffle.crop import draw_crops

    if decode._jpeg_region is None:
        raise SystemExit("region_decode: dimd.shuffle._jpeg_region is not built in this install")
    packed = PackedDataset(args.train)
    count = min(args.images, len(packed.names))
    records = [bytes(packed.record(i)) for i in range(count)]
    region_decoder = decode._jpeg_region
    results: dict[str, Any] = {}
    for kind in ("train", "eval"):
        runs = []
        for run in range(args.runs):
            draws = draw_crops(np.random.default_rng(run), count)
            crops = [draws.row(i)[:2] for i in range(count)]
            timing = {}
            outputs = {}
            for way in (("full", "region") if run % 2 else ("region", "full")):   # alternate the order
                decode._jpeg_region = region_decoder if way == "region" else None
                timing[way], outputs[way] = one_way(records, crops, args.image_size, kind == "eval")
            decode._jpeg_region = region_decoder
            if not all(np.array_equal(a, b) for a, b in zip(outputs["region"], outputs["full"])):
                raise SystemExit("region_decode: the two ways gave different crops")
            runs.append({"full_us": 1e6 * timing["full"], "region_us": 1e6 * timing["region"],
                         "ratio": timing["full"] / timing["region"]})
            print(f"{kind} run {run + 1}/{args.runs}: full {runs[-1]['full_us']:.0f} µs, region "
                  f"{runs[-1]['region_us']:.0f} µs per image: {runs[-1]['ratio']:.2f}x", file=sys.stderr)
        results[kind] = {key: spread(r[key] for r in runs) for key in ("full_us", "region_us", "ratio")}
    return {"images": count, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train", type=Path, help="a packed set (the stem dimd pack wrote)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--images", type=int, default=800, help="records per run (the first N)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    document = measure(args)
    for kind, figures in document["results"].items():
        print(f"{kind}: full decode {figures['full_us']['median']:.0f} µs, region "
              f"{figures['region_us']['median']:.0f} µs per image (medians of {args.runs}); full / region "
              f"{figures['ratio']['median']:.2f}x ({figures['ratio']['min']:.2f}-{figures['ratio']['max']:.2f})")
    if args.json is not None:
        from dimd.report import result_document, write_json

        write_json(args.json, result_document("bench/probes/region_decode.py", {**vars(args), "json": str(args.json)},
                                              document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
