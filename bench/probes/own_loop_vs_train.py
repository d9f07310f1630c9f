#!/usr/bin/env python3
"""examples/own_loop.py against ``dimd train --model examples/own_loop.py:small_cnn``: same model, batch, data.

Both train the example's CNN from the same seed on the same packed sample set,
with the same per-rank batch, learning rate (unscaled, constant), momentum, no
weight decay, crop scale and image size, on the same P ranks; neither
reshuffles the store. The runs alternate (``runs`` of each, interleaved) and
the figures are medians: training images/s and the last epoch's validation
top-1. The library path should match dimd's own loop within 10% in speed and
2 points in accuracy::

    .venv/bin/python bench/probes/own_loop_vs_train.py --runs 3 --json own_loop_vs_train.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

#: bench/: the helpers the reproductions share (_common), which this probe uses too.
BENCH = Path(__file__).resolve().parent.parent
EXAMPLE = BENCH.parent / "examples" / "own_loop.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    sys.path.insert(1, str(BENCH))
    from _common import BIN, WORK, json_job, machine, read_result, sample_set

    data = sample_set(args.classes, args.per_class, 8, log=lambda line: print(line, file=sys.stderr))
    common = [data.train, "--val", data.val, "--epochs", args.epochs, "--batch-size", args.batch_size,
              "--lr", args.lr]
    setups = {
        "own_loop": [BIN / "mpiexec", "-n", args.np, sys.executable, EXAMPLE, *common],
        "dimd_train": [BIN / "mpiexec", "-n", args.np, BIN / "dimd", "train", *common,
                       "--model", f"{EXAMPLE}:small_cnn", "--image-size", 32, "--crop-scale", 0.35,
                       "--no-lr-scaling", "--schedule", "constant", "--momentum", 0.9, "--weight-decay", 0,
                       "--shuffle-every", "never", "--seed", 0],
    }
    folder = WORK / "runs" / "own_loop_vs_train"
    found: dict[str, dict[str, list[float]]] = {name: {"images_per_s": [], "val_top1": []} for name in setups}
    for run in range(args.runs):
        for name, argv in setups.items():
            path = folder / f"{name}-{run}.json"
            json_job(argv, path, timeout=900)
            result = read_result(path)["result"]
            for key in found[name]:
                found[name][key].append(float(result[key]))
            print(f"run {run} {name}: {result['images_per_s']:.1f} img/s, val top-1 "
                  f"{100 * result['val_top1']:.1f}% (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    medians = {name: {key: statistics.median(v) for key, v in values.items()} for name, values in found.items()}
    ratio = medians["own_loop"]["images_per_s"] / medians["dimd_train"]["images_per_s"]
    points = 100 * (medians["own_loop"]["val_top1"] - medians["dimd_train"]["val_top1"])
    figures = {"runs": found, "medians": medians, "speed_ratio_own_loop_to_train": ratio,
               "top1_points_own_loop_minus_train": points, "machine": machine()}
    print(f"own_loop / dimd train images/s: {ratio:.3f}; val top-1 difference {points:+.1f} points")
    if args.json:
        from dimd.report import result_document, write_json

        write_json(Path(args.json), result_document("bench/probes/own_loop_vs_train.py", vars(args), figures))


if __name__ == "__main__":
    main()
