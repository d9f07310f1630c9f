#!/usr/bin/env python3
"""DistributedGradients' buckets against DDP's reducer on one gloo group: the gradient mechanism alone, per step.

One MPI job, one gloo group (started from MPI), the same model, batch and
optimizer for every set-up, interleaved in blocks (``rounds`` rounds of
``steps`` timed steps each, after a warm-up block), on one fixed random batch
per rank so that only the step and the reduction count (no loader):

* ``DDP``        ``torch.nn.parallel.DistributedDataParallel`` (its C++ reducer; buckets of 25 MiB after a first
                 one of 1 MiB; the gradients copied into its buckets);
* ``thread``     ``DistributedGradients(algorithm="torch")`` as it was: each bucket handed to dimd's
                 communication thread, which sums it over the group through a numpy view, waited for as
                 backward ends; ``optimizer.zero_grad()``'s fresh gradients copied back by the hooks;
* ``device``     ``DistributedGradients(algorithm="torch")`` now: each bucket's ``all_reduce(async_op=True)``
                 started from the hook that completes it (gloo's own threads run it), the released gradients
                 pointed back into the zeroed buffer before the forward pass, the first bucket cut at 1 MiB
                 (DDP's rule: the last layers' bucket starts while most of backward is still to run);
* ``device, whole buckets``  the same with buckets of 25 MiB from the first (one bucket for resnet20).

One wrapper is alive at a time (while two are, neither starts a bucket during backward): each block
builds its set-up anew, outside the clock.

The loop is DDP's script's: ``zero_grad()``, forward, loss, ``backward()``, ``step()``. Figures per set-up:
the median step over every timed step (robust to another process's burst), its interquartile range, and
images/s from the median; ratios against DDP, overall and paired round by round (each block against DDP's
block of the same round and rank: the machine's slow spells hit both)::

    mpiexec -n 2 python -m mpi4py bench/probes/reducer_vs_ddp.py --model resnet20 --batch-size 32 --json r.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

SETUPS = ("DDP", "thread", "device, whole buckets", "device")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--rounds", type=int, default=10, help="blocks of each set-up, interleaved")
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import dimd
    from dimd.allreduce import start_group
    from dimd.allreduce.torchdist import torch_allreduce
    from dimd.report import result_document, write_json
    from dimd.train.buckets import GradientBuckets
    from dimd.train.models import build_model

    comm, _ = dimd.init(device="cpu", threads=args.threads)
    rank = comm.Get_rank()
    group = start_group(comm, "gloo")
    g = torch.Generator().manual_seed(rank)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    labels = torch.randint(0, 10, (args.batch_size,), generator=g)

    def setup(name: str) -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = build_model(args.model, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name == "DDP":
            return DistributedDataParallel(model), optimizer, None
        grads = dimd.DistributedGradients(model, comm, algorithm="torch", optimizer=optimizer)
        if name != "device":   # the buckets as they were: whole ones, and (thread) the communication thread
            grads.buckets.close()
            thread = name == "thread"
            grads.buckets = GradientBuckets(
                model.parameters(), lambda array: torch_allreduce(array, comm), comm.Get_size(),
                bucket_bytes=25 << 20, overlap=True, at_backward_end=grads.synchronize, first_bucket_bytes=0,
                device_reduce=None if thread else grads.group)
            if thread:   # nor were released gradients pointed back into the buffer before the forward pass
                grads.buckets.attach_if_released = lambda: False
        return model, optimizer, grads

    times: dict[str, list[float]] = {name: [] for name in SETUPS}
    for block in range(args.rounds + 1):                     # the first round warms up, untimed
        for name in SETUPS:
            model, optimizer, grads = setup(name)
            comm.Barrier()
            for step in range(args.steps + 1):                # the first step of a block is not timed
                t0 = time.perf_counter()
                optimizer.zero_grad()
                F.cross_entropy(model(images), labels).backward()
                optimizer.step()
                if block and step:
                    times[name].append(time.perf_counter() - t0)
            if grads is not None:
                grads.close()
    group.close()
    everyone = comm.gather(times)
    if rank != 0:
        return
    figures: dict[str, Any] = {}
    for name in SETUPS:
        steps = [t for rank_times in everyone for t in rank_times[name]]
        q1, median, q3 = statistics.quantiles(steps, n=4)
        figures[name] = {"median_step_ms": 1e3 * median, "iqr_ms": [1e3 * q1, 1e3 * q3],
                         "images_per_s": args.batch_size * comm.Get_size() / median, "steps": len(steps)}
    for name in SETUPS[1:]:
        figures[f"{name} / DDP images/s"] = figures[name]["images_per_s"] / figures["DDP"]["images_per_s"]
        # paired: each round's block against DDP's block of the same round on the same rank (minutes apart
        # at most, so a slow spell of the machine hits both), the ratio of their median steps
        paired = [statistics.median(theirs[i:i + args.steps]) / statistics.median(mine[i:i + args.steps])
                  for rank_times in everyone
                  for theirs, mine in [(rank_times["DDP"], rank_times[name])]
                  for i in range(0, len(mine), args.steps)]
        q1, median, q3 = statistics.quantiles(paired, n=4)
        figures[f"{name} / DDP, paired by round"] = {"median": median, "iqr": [q1, q3], "pairs": len(paired)}
    for name, value in figures.items():
        print(name, value)
    if args.json:
        write_json(args.json, result_document("bench/probes/reducer_vs_ddp.py", vars(args), figures))


if __name__ == "__main__":
    main()
