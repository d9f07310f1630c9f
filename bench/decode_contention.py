#!/usr/bin/env python3
"""How much the loader's decoding threads slow a small model's training step (the GIL).

dimd's loader decodes in threads of the training process. Pillow releases the
GIL while it decodes, but the loader's Python around it and torch's
re-acquisitions (every op, the autograd engine) contend for it, so a step of
a small model, made of many short ops, waits for the decoding thread. This
times forward + backward + optimizer of MODEL at batch B (one torch thread, a
fixed synthetic batch, as `dimd plan-batch step-time` does) alone and with 1
and 2 threads decoding the packed set's records with dimd's training decode
as fast as they can, then alone again; medians of ``--repeats`` x ``--steps``.
It is the measurement behind step-time's `--data`
(docs/plan-batch.md#step-1-step-time): the free-running decoders here are the
worst case, the loader's bounded prefetch a milder one.

    .venv/bin/python bench/decode_contention.py bench/work/data/mnist/train --json build/decode_contention.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packed", help="a packed training set (its records are decoded alongside)")
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--batch-size", type=int, default=14)
    parser.add_argument("--decoders", default="0,1,2,0", help="decoding threads per measurement, in order")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    import torch.nn.functional as F

    from dimd.format import PackedDataset
    from dimd.report import result_document, spread, write_json
    from dimd.shuffle.decode import decode_train
    from dimd.train.flatgrad import FlatGradients
    from dimd.train.models import build_model
    from dimd.train.sgd import Normalize, make_optimizer

    torch.set_num_threads(1)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    data = PackedDataset(args.packed)
    records = [bytes(data.record(i)) for i in range(len(data))]
    model = build_model(args.model, len(data.classes))
    optimizer = make_optimizer(model, lr=0.01, momentum=0.9, weight_decay=5e-4)
    flat = FlatGradients(model.parameters())
    normalize = Normalize(torch.device("cpu"))
    size = args.image_size
    images = torch.randint(0, 256, (args.batch_size, 3, size, size), dtype=torch.uint8)
    labels = torch.randint(0, len(data.classes), (args.batch_size,))

    def step_ms(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            flat.zero()
            F.cross_entropy(model(normalize(images)), labels).backward()
            optimizer.step()
        return (time.perf_counter() - start) / steps * 1e3

    stop = threading.Event()
    decoded = [0]

    def decode_forever(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            decode_train(records[int(rng.integers(len(records)))], size, rng, (0.7, 1.0))
            decoded[0] += 1

    step_ms(50)   # warm-up
    rows: list[dict[str, Any]] = []
    for count in (int(k) for k in args.decoders.split(",")):
        stop.clear()
        threads = [threading.Thread(target=decode_forever, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        decoded[0], started = 0, time.perf_counter()
        times = [step_ms(args.steps) for _ in range(args.repeats)]
        rate = decoded[0] / (time.perf_counter() - started)
        stop.set()
        for thread in threads:
            thread.join()
        rows.append({"decoders": count, "step_ms": spread(times), "decoded_per_s": round(rate, 1)})
        print(f"{count} decoding thread(s): step {statistics.median(times):.3f} ms "
              f"(min {min(times):.3f}, max {max(times):.3f}); {rate:,.0f} images decoded/s alongside", flush=True)
    alone = statistics.median(r["step_ms"]["median"] for r in rows if r["decoders"] == 0)
    for row in rows:
        row["step_over_alone"] = round(row["step_ms"]["median"] / alone, 2)
    if args.json:
        write_json(args.json, result_document("bench/decode_contention.py", vars(args) | {"json": str(args.json)},
                                              {"rows": rows}))


if __name__ == "__main__":
    main()
