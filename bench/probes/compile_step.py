#!/usr/bin/env python3
"""The training step of the zoo's models eager and under ``torch.compile``, on this machine's CPU, with the
compile time: what ``--compile`` would buy.

A step is what ``dimd train``'s S-SGD step computes on one rank: forward,
cross-entropy, backward and torch's SGD step (momentum 0.9, weight decay on
weights only, :func:`dimd.train.sgd.make_optimizer`), on a fixed random batch
in channels-first float32. ``torch.compile`` compiles the model (forward and,
through AOTAutograd, backward); the optimizer stays eager. Each run is a fresh
process with an empty inductor cache (the compile is cold, as a run's first is),
which compiles first (the compile time is the first compiled step's time less a
compiled step's median), then alternates the two ways' steps one by one, the
way that starts turned round run by run. The figures are
the medians over the runs of each run's median step, and of each run's ratio
eager / compiled, with ``/proc/loadavg`` before each run (the machine may be shared).

    python bench/probes/compile_step.py --runs 3 --json build/compile_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

#: (model, image size px, per-rank batch): the three the measurement asks for.
CASES = (("lenet", 32, 64), ("resnet20", 32, 64), ("resnet18", 64, 32))


def make_step(model_name: str, size: int, batch: int, compiled: bool) -> Callable[[], float]:
    """One way's step on its own copy of the model (the same initial weights): returns its seconds."""
    import torch

    from dimd.train.models import build_model
    from dimd.train.sgd import make_optimizer

    torch.manual_seed(0)
    model = build_model(model_name, 10)
    optimizer = make_optimizer(model, lr=0.01, momentum=0.9, weight_decay=5e-4)
    forward = torch.compile(model) if compiled else model
    images = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, 10, (batch,))

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(forward(images), labels).backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def child(args: argparse.Namespace) -> None:
    """One run: the compiled step's first call (the compile), then both ways' steps alternated one by one
    (a load that drifts during the run falls on both alike), the way that starts turned round by the run's
    ``order``; JSON on stdout."""
    import statistics

    import torch

    torch.set_num_threads(args.threads)
    steps = {way: make_step(args.model, args.size, args.batch, way == "compiled") for way in ("eager", "compiled")}
    first = steps["compiled"]()
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    ways = args.order.split(",")
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.steps):
        for way in ways:
            times[way].append(steps[way]())
    medians = {way: statistics.median(seconds) for way, seconds in times.items()}
    print(json.dumps({way: {"step_s": medians[way], "first_s": first if way == "compiled" else None}
                      for way in ways}))


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from dimd.report import spread

    results = {}
    for model, size, batch in CASES:
        if args.models and model not in args.models:
            continue
        runs = []
        for run in range(args.runs):
            order = "eager,compiled" if run % 2 == 0 else "compiled,eager"
            load = load_average()
            with tempfile.TemporaryDirectory(prefix="dimd-inductor-") as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                       "OMP_NUM_THREADS": str(args.threads)}
                proc = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--size", str(size),
                                       "--batch", str(batch), "--order", order, "--steps", str(args.steps),
                                       "--warmup", str(args.warmup), "--threads", str(args.threads)],
                                      capture_output=True, text=True, env=env, timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"compile_step: {model} run {run + 1} failed:\n{proc.stderr[-2000:]}")
            ways = json.loads(proc.stdout.strip().splitlines()[-1])
            eager, compiled = ways["eager"], ways["compiled"]
            runs.append({"load_average": load, "order": order, "eager_ms": 1e3 * eager["step_s"],
                         "compiled_ms": 1e3 * compiled["step_s"],
                         "speedup": eager["step_s"] / compiled["step_s"],
                         "compile_s": compiled["first_s"] - compiled["step_s"]})
            r = runs[-1]
            print(f"{model} {size} px batch {batch}, run {run + 1}/{args.runs} (load {load}): eager "
                  f"{r['eager_ms']:.1f} ms, compiled {r['compiled_ms']:.1f} ms ({r['speedup']:.2f}x), compile "
                  f"{r['compile_s']:.1f} s", file=sys.stderr)
        results[model] = {"image_size": size, "batch": batch, "runs": runs,
                          **{key: spread(r[key] for r in runs)
                             for key in ("eager_ms", "compiled_ms", "speedup", "compile_s")}}
    import torch

    return {"torch": torch.__version__, "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
            "models": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per way and run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine may be shared)")
    parser.add_argument("--models", nargs="*", default=None, help=f"a subset of {[c[0] for c in CASES]}")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--order", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    document = measure(args)
    for model, f in document["models"].items():
        print(f"{model} at {f['image_size']} px, batch {f['batch']}, {args.threads} thread(s): eager "
              f"{f['eager_ms']['median']:.1f} ms, compiled {f['compiled_ms']['median']:.1f} ms per step: "
              f"{f['speedup']['median']:.2f}x ({f['speedup']['min']:.2f}-{f['speedup']['max']:.2f}); compile "
              f"{f['compile_s']['median']:.1f} s (medians of {args.runs}; loads "
              f"{'; '.join(r['load_average'] for r in f['runs'])})")
    if args.json is not None:
        from dimd.report import result_document, write_json

        write_json(args.json, result_document("bench/probes/compile_step.py",
                                              {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                               if k not in ("child", "model", "size", "batch", "order")},
                                              document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
