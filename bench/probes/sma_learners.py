"""Hardware efficiency of K learners on one rank: training images/s for K = 1, 2, 4 at small batches.

Crossbow trains several small-batch learners per GPU because one small batch
leaves the device idle. This measures whether K learners beat one on this
machine, for each way dimd can compute them (``--learner-compute``):
``loop`` (one replica after another) and ``threads`` (K threads, each with
its share of torch's threads). The results on file also time a third,
``vmap``, the slowest at every point and since removed. One learner step is what `dimd train --sync sma` does per
step without the data loading: forward, backward, the learner update.

    python bench/probes/sma_learners.py                      # writes bench/probes/results/sma_learners.json
    python bench/probes/sma_learners.py --quick --json /tmp/l.json

Run it with the threads one rank has (`--threads`, default: all cores), on a
quiet machine: every figure is a median of ``--repeats`` timings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"lenet": 28, "resnet20": 32}


def images_per_second(model: str, size: int, k: int, batch: int, compute: str, threads: int,
                      steps: int, repeats: int) -> list[float]:
    from dimd.train.learners import Learners
    from dimd.train.models import build_model
    from dimd.shuffle.normalize import Normalize

    torch.manual_seed(0)
    group = Learners(build_model(model, 10), k, compute=compute, threads=threads,
                     normalize=Normalize(torch.device("cpu")))
    g = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 255, (batch, 3, size, size), dtype=torch.uint8, generator=g) for _ in range(k)]
    labels = [torch.randint(0, 10, (batch,), generator=g) for _ in range(k)]

    def step() -> None:
        key, _ = group.gradients(images, labels)
        group.update(key, 0.01, 0.9, None)

    for _ in range(2):
        step()                                   # warm-up: allocations
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        runs.append(k * batch * steps / (time.perf_counter() - t0))
    group.close()
    return runs


def main(argv: list[str] | None = None) -> None:
    from dimd.host import available_cores
    from dimd.report import result_document, spread, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="lenet,resnet20")
    parser.add_argument("--learners", default="1,2,4")
    parser.add_argument("--batches", default="4,8,16")
    parser.add_argument("--computes", default="loop,threads")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the rank [default: all cores]")
    parser.add_argument("--steps", type=int, default=20, help="learner steps per timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="lenet only, 5 steps, 1 repeat")
    parser.add_argument("--json", type=Path, default=RESULTS / "sma_learners.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.repeats = "lenet", 5, 1
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    rows = []
    for model in args.models.split(","):
        size = MODELS[model]
        for batch in map(int, args.batches.split(",")):
            for k in map(int, args.learners.split(",")):
                for compute in args.computes.split(","):
                    runs = images_per_second(model, size, k, batch, compute, threads, args.steps, args.repeats)
                    row = {"model": model, "image_size": size, "batch": batch, "learners": k,
                           "compute": compute, "images_per_s": spread(runs)}
                    rows.append(row)
                    print(f"{model:9} b={batch:<3} K={k} {compute:8} {statistics.median(runs):9.0f} img/s",
                          file=sys.stderr, flush=True)
    # K learners against one, per model, batch and compute: the hardware efficiency
    one = {(r["model"], r["batch"], r["compute"]): r["images_per_s"]["median"] for r in rows if r["learners"] == 1}
    for r in rows:
        r["speedup_over_one_learner"] = r["images_per_s"]["median"] / one[(r["model"], r["batch"], r["compute"])]
    best = {}
    for r in rows:
        key = f"{r['model']} b={r['batch']} K={r['learners']}"
        if key not in best or r["images_per_s"]["median"] > best[key]["images_per_s"]:
            best[key] = {"compute": r["compute"], "images_per_s": r["images_per_s"]["median"]}
    figures = {"threads": threads, "rows": rows, "fastest": best}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, result_document("bench/probes/sma_learners.py", vars(args), figures))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
