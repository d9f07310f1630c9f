#!/usr/bin/env python3
"""Crossbow's figure on one GPU: time to accuracy, S-SGD at its best batch against SMA with graphed learners.

    python bench/sma_tta_gpu.py            # needs CUDA; about 40 minutes on one H100 (3 seeds)
    python bench/sma_tta_gpu.py --quick    # a smoke test: a small set, one seed, a few epochs

Without a CUDA device it prints one line and exits 2. One rank, one GPU, resnet20 at 32 px on a generated set of
``--per-class`` x 10 classes (``dimd sample-data``, 50,000 training images by default, packed at a short side of
36 px: large enough that 24 epochs matter, small enough to decode at the GPU's pace):

* ``ssgd-bN``: S-SGD at batch N for N in ``--ssgd-batches``, each at the best rate of ``--lr-grid`` (given for a
  batch of 256, scaled linearly) on the first seed; its steps replay as CUDA graphs where the default rule says
  they run faster (small batches), else eagerly: the faster of the two, as a user gets it;
* ``sma-K`` for K in ``--learners`` and ``sma-auto``: SMA with K learners of batch ``--batch``, graphed, alpha
  1/K, at the rate of the S-SGD set-up with the same batch.

The clock is the engine's (each epoch's ``elapsed``: loading, evaluation and captures included, as MLPerf
times). Time and epochs to ``--target`` validation top-1 are medians over ``--seeds``. The curves and the bars
are drawn as bench/sma_tta.py draws the CPU's, and the figure joins the gallery beside it (opt-in).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from _common import Context, JobError, Reproduction, dimd_job, gpu_decode_workers, no_cuda_line, sample_set
from sma_tta import draw, findings, rank_key, summarise, to_target

FULL = {"per_class": 5000, "val_per_class": 100, "short_side": 36, "batch": 16, "ssgd_batches": [16, 64, 256],
        "learners": [1, 2, 4], "seeds": [0, 1, 2], "epochs": 24, "lr_grid": [0.1, 0.2, 0.4], "target": 0.95,
        "crop_scale": 0.35, "weight_decay": 5e-4}
SCRIPT = "bench/sma_tta_gpu.py"
QUICK = {"per_class": 200, "val_per_class": 20, "ssgd_batches": [16, 64], "learners": [2], "seeds": [0],
         "epochs": 3, "lr_grid": [0.2], "target": 0.5}


def train(data: Any, setup: dict[str, Any], seed: int, p: dict[str, Any], work: Path, workers: int) -> dict[str, Any]:
    """One `dimd train` run on the GPU: its (elapsed, val top-1, epoch) curve, images/s and how it ran."""
    out = work / f"{setup['name']}-lr{setup['lr']}-s{seed}.json"
    command = ["train", data.train, "--val", data.val, "--model", "resnet20", "--image-size", 32,
               "--epochs", p["epochs"], "--batch-size", setup["batch"], "--lr", setup["lr"], "--schedule", "step",
               "--milestones", round(0.75 * p["epochs"]), "--crop-scale", p["crop_scale"],
               "--weight-decay", p["weight_decay"], "--device", "cuda", "--decode-workers", workers, "--seed", seed]
    if setup["sync"] == "sma":
        command += ["--sync", "sma", "--learners", setup["learners"], "--cuda-graphs"]
    t0 = time.perf_counter()
    result = dimd_job(command, out)["result"]
    curve = [(e["elapsed"], e["val_top1"], e["epoch"]) for e in result["history"]]
    return {"seed": seed, "curve": curve, "images_per_s": result["images_per_s"], "wall_s": time.perf_counter() - t0,
            "learners_per_rank": result["learners_per_rank"], "alpha": result.get("alpha"),
            "autotune": result.get("autotune"), "cuda_graphs": result["cuda_graphs"]}


def compare(p: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """Every set-up's runs (their JSONs in the reproduction's folder), summarised as bench/sma_tta.py does."""
    workers, work, log = gpu_decode_workers(), ctx.folder(), ctx.log
    data = sample_set(10, p["per_class"], p["val_per_class"], work=ctx.work, log=log, short_side=p["short_side"])
    setups: dict[str, dict[str, Any]] = {}
    chosen: dict[str, Any] = {}
    for batch in p["ssgd_batches"]:
        name = f"ssgd-b{batch}"
        trials = {}
        for lr in p["lr_grid"]:                       # the rate: the best of the grid on the first seed
            setup = {"name": name, "sync": "ssgd", "batch": batch, "lr": lr}
            trials[lr] = [train(data, setup, p["seeds"][0], p, work, workers)]
            log(f"{name} lr {lr}: {summarise(trials[lr], p['target'])['time_to_target_s']}")
        best = min(p["lr_grid"], key=lambda lr: rank_key(summarise(trials[lr], p["target"])))
        chosen[name] = {"lr": best, "grid": {str(lr): summarise(t, p["target"]) for lr, t in trials.items()}}
        setup = {"name": name, "sync": "ssgd", "batch": batch, "lr": best}
        runs = trials[best] + [train(data, setup, seed, p, work, workers) for seed in p["seeds"][1:]]
        setups[name] = {**setup, "runs": runs}
    sma_lr = chosen.get(f"ssgd-b{p['batch']}", next(iter(chosen.values())))["lr"]
    for learners in [*map(str, p["learners"]), "auto"]:
        name = f"sma-{learners}"
        setup = {"name": name, "sync": "sma", "batch": p["batch"], "lr": sma_lr, "learners": learners}
        runs = []
        for seed in p["seeds"]:
            runs.append(train(data, setup, seed, p, work, workers))
            log(f"{name} seed {seed}: {to_target(runs[-1]['curve'], p['target'])}")
        setups[name] = {**setup, "runs": runs}
    summaries = {name: summarise(s["runs"], p["target"]) for name, s in setups.items()}
    best_ssgd = min((n for n in summaries if n.startswith("ssgd")), key=lambda n: rank_key(summaries[n]))
    auto, ssgd = summaries["sma-auto"]["time_to_target_s"]["median"], summaries[best_ssgd]["time_to_target_s"]["median"]
    base = "sma-1" if "sma-1" in summaries else best_ssgd
    one = summaries[base]["images_per_s"]["median"]
    return {"dataset": "sample-data", "model": "resnet20", "image_size": 32, "batch": p["batch"],
            "epochs": p["epochs"], "target": p["target"], "ranks": 1, "records": data.records, "ssgd_lr": chosen,
            "sma_lr": sma_lr,
            "setups": {n: {**{k: v for k, v in s.items() if k != "runs"}, **summaries[n], "runs": s["runs"]}
                       for n, s in setups.items()},
            "best_ssgd": best_ssgd, "sma_auto_over_best_ssgd": auto / ssgd if auto and ssgd else None, "aim": 0.7,
            "hardware_efficiency_over": base,
            "hardware_efficiency": {n: s["images_per_s"]["median"] / one for n, s in summaries.items() if one},
            "statistical_efficiency_epochs": {n: s["epochs_to_target"]["median"] for n, s in summaries.items()}}


def measure(ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    problem = no_cuda_line(SCRIPT)
    if problem:
        raise JobError(problem)
    import torch

    p = ctx.size(FULL, QUICK)
    comparison = compare(p, ctx)
    return p, {"comparisons": [comparison], "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}


REPRODUCTION = Reproduction(
    name="sma_tta_gpu",
    title="Crossbow on one GPU: time to accuracy, S-SGD at its best batch against SMA with graphed learners",
    claim=("Crossbow's SMA reaches the target accuracy 1.3-4x sooner than S-SGD (its figures 9-10): several "
           "small-batch learners per GPU keep it busy, and small batches need fewer epochs. With each learner's step "
           "captured as a CUDA graph, K learners of batch 16 run at large-batch speed on one GPU; the aim is SMA auto "
           "in at most 0.7x the time of the best S-SGD."),
    measure=measure, plot=lambda envelope: draw(envelope["result"]["comparisons"]), findings=findings,
    minutes=40.0, default=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test of the pipeline, not a result")
    for name in ("per_class", "epochs", "batch"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {FULL[name]}")
    parser.add_argument("--target", type=float, help=f"validation top-1 to reach (default {FULL['target']})")
    parser.add_argument("--seeds", help="comma-separated (default 0,1,2)")
    args = parser.parse_args(argv)
    FULL.update({k: getattr(args, k) for k in ("per_class", "epochs", "batch", "target") if getattr(args, k)})
    if args.seeds:
        FULL["seeds"] = [int(s) for s in args.seeds.split(",")]
    import reproduce

    return reproduce.measure_on_gpu(REPRODUCTION, args.quick, no_cuda_line(SCRIPT))

if __name__ == "__main__":
    sys.exit(main())
