#!/usr/bin/env python3
"""Overlapping the gradient allreduce with backward: what it hides, and why little on two shared cores.

One MPI job, every set-up interleaved (``reps`` rounds of each, ``steps``
timed steps per round, medians), on random batches so only compute and
communication count:

* ``compute``     the step with the buckets' hooks but no allreduce (the floor);
* ``after``       every bucket reduced after backward, on the main thread (``overlap=False``);
* ``thread``      each bucket reduced on the communication thread as backward completes it (dimd's choice);
* ``iallreduce``  each bucket's ``MPI_Iallreduce`` started from the hook, waited for at the step: no
                  thread, progress only inside MPI calls;
* ``iallreduce+test``  the same, with ``MPI_Testall`` in every later hook to drive progress by hand.

Figures per set-up: the step time, the exposed allreduce (step minus ``compute``), the share of
``after``'s exposed allreduce that is hidden, and, to say why, how long backward itself took and how
long the buckets' reductions took while it ran (against the same reductions after it; for the
``iallreduce`` set-ups, the time in the final ``MPI_Waitall``: what did not progress by itself)::

    mpiexec -n 2 python -m mpi4py bench/probes/overlap.py --model vgg16 --batch-size 4 --json overlap.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

MODES = ("compute", "after", "thread", "iallreduce", "iallreduce+test")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg16")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--algorithm", default="mpi", help="for 'after' and 'thread' (iallreduce is MPI's)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json")
    args = parser.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F

    import dimd
    from dimd.allreduce import allreduce
    from dimd.report import result_document, write_json
    from dimd.train.buckets import GradientBuckets
    from dimd.train.models import build_model

    comm, device = dimd.init(device="cpu")
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    modes = args.modes.split(",")
    torch.manual_seed(0)
    model = build_model(args.model, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    reduce_seconds: list[float] = []

    def timed_reduce(array: np.ndarray) -> None:
        t0 = time.perf_counter()
        allreduce(array, comm, args.algorithm)   # MPI: the bucket summed over ranks
        reduce_seconds.append(time.perf_counter() - t0)

    class Nonblocking(GradientBuckets):
        """Buckets started as MPI_Iallreduce from the hooks (main thread), completed at synchronize."""

        def __init__(self, *a: Any, test: bool, **k: Any) -> None:
            super().__init__(*a, **k)
            self.test, self.requests = test, []

        def _start(self, bucket: int) -> None:
            start, stop = self.bounds[bucket]
            self.requests.append(comm.Iallreduce(MPI.IN_PLACE, self.flat.host_array[start:stop], op=MPI.SUM))

        def _on_gradient(self, index: int, parameter: Any) -> None:
            super()._on_gradient(index, parameter)
            if self.test and self.requests:
                MPI.Request.Testall(self.requests)   # MPI: progress by hand

        def synchronize(self) -> None:
            super().synchronize()
            t0 = time.perf_counter()
            MPI.Request.Waitall(self.requests)   # what did not progress during backward is done here
            reduce_seconds.append(time.perf_counter() - t0)
            self.requests = []
            self.flat.grads.div_(size)

    def buckets_for(mode: str) -> GradientBuckets:
        bucket_bytes = int(args.bucket_mb * (1 << 20))
        if mode.startswith("iallreduce"):
            return Nonblocking(model.parameters(), timed_reduce, size, bucket_bytes=bucket_bytes,
                               test=mode.endswith("test"))
        reduce = (lambda a: None) if mode == "compute" else timed_reduce
        return GradientBuckets(model.parameters(), reduce, size, bucket_bytes=bucket_bytes,
                               overlap=mode == "thread")

    samples: dict[str, dict[str, list[float]]] = {m: {"step": [], "backward": [], "reduce": []} for m in modes}
    for rep in range(args.reps + 1):   # round 0 warms up, untimed
        for mode in modes:
            buckets = buckets_for(mode)
            comm.Barrier()
            for _ in range(args.steps):
                reduce_seconds.clear()
                t0 = time.perf_counter()
                buckets.zero()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                t1 = time.perf_counter()
                buckets.synchronize()
                optimizer.step()
                t2 = time.perf_counter()
                if rep:
                    samples[mode]["step"].append(t2 - t0)
                    samples[mode]["backward"].append(t1 - t0)
                    samples[mode]["reduce"].append(sum(reduce_seconds))
            buckets.close()
            comm.Barrier()

    def median_over_ranks(values: list[float]) -> float:
        return float(np.mean(comm.allgather(statistics.median(values))))   # MPI: every rank's median

    figures = {m: {k: median_over_ranks(v) for k, v in samples[m].items()} for m in modes}
    floor = figures.get("compute", {}).get("step")
    if floor is not None:
        for m in modes:
            figures[m]["exposed_allreduce"] = figures[m]["step"] - floor
    if floor is not None and "after" in figures:
        after = figures["after"]["exposed_allreduce"]
        for m in modes:
            figures[m]["hidden_share"] = 1 - figures[m]["exposed_allreduce"] / after if after > 0 else None
        figures["after"]["allreduce_share_of_step"] = after / figures["after"]["step"]
    flat = buckets_for("compute")
    result = {"modes": figures, "world_size": size, "gradient_bytes": flat.flat.numel * 4,
              "buckets": flat.buckets, "threads": torch.get_num_threads(), "load_average": list(os.getloadavg())}
    flat.close()
    if rank == 0:
        for m in modes:
            f = figures[m]
            print(f"{m:>16}: step {1e3 * f['step']:7.1f} ms  backward {1e3 * f['backward']:7.1f} ms  "
                  f"reduce {1e3 * f['reduce']:7.1f} ms  exposed {1e3 * f.get('exposed_allreduce', 0):7.1f} ms  "
                  f"hidden {f.get('hidden_share')}", flush=True)
        if args.json:
            write_json(args.json, result_document("bench/probes/overlap.py", vars(args), result))


if __name__ == "__main__":
    main()
