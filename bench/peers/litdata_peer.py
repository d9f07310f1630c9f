#!/usr/bin/env python
"""litdata 0.2.76 (build/peers/litdata): chunked binary files made by ``optimize``, read by
``StreamingDataset`` in DataLoader workers.

pack    ``optimize(fn, inputs=range(N), num_workers=N_WORKERS, chunk_bytes="64MB")`` where
        ``fn(i)`` returns ``{"index": i, "label": label, "image": the manifest's JPEG bytes}``
        (bytes are stored as they are; litdata's own JPEG path would open the image with
        Pillow, and its reader prefers torchvision's decoder, which this venv lacks).
verify  ``StreamingDataset(shuffle=False)``, every item, undecoded.
load    ``StreamingDataset(data, shuffle=True, seed=K, transform=augmentation)`` (the
        augmentation: torchvision's RandomResizedCrop + flip + PILToTensor written with
        Pillow, bench/peers/_peer.py) in a ``StreamingDataLoader(batch_size=B,
        num_workers=N, persistent_workers=True)``.
"""

from __future__ import annotations

import functools
from pathlib import Path

from _peer import LoadOptions, Manifest, Peer, WorkerRng, main, pil_train_sample


def _item(manifest: Manifest, i: int) -> dict:
    r = manifest.records[i]
    return {"index": i, "label": r.label, "image": manifest.data(r)}


def pack(manifest: Manifest, out: Path, workers: int) -> dict:
    import os
    import shutil
    import tempfile

    # optimize's scratch (a cache folder, a list of the items it leaves behind) inside `out`, not /tmp
    scratch = out / "scratch"
    scratch.mkdir()
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(scratch / "cache")
    tempfile.tempdir = str(scratch)
    from litdata import optimize

    optimize(fn=functools.partial(_item, manifest), inputs=list(range(len(manifest.records))),
             output_dir=str(out / "chunks"), num_workers=workers, chunk_bytes="64MB", verbose=False)
    shutil.rmtree(scratch)
    (out / "names.txt").write_text("".join(f"{r.name}\n" for r in manifest.records))
    return {"processes": workers, "chunks": len(list((out / "chunks").glob("*.bin")))}


def records(data: Path):
    from litdata import StreamingDataset

    names = (data / "names.txt").read_text().splitlines()
    for item in StreamingDataset(str(data / "chunks"), shuffle=False):
        yield names[int(item["index"])], int(item["label"]), item["image"]


class _Augment:
    def __init__(self, size: int, seed: int) -> None:
        self.size, self.rng = size, WorkerRng(seed)

    def __call__(self, item: dict):
        return pil_train_sample(item["image"], self.size, self.rng()), item["label"]


def loader(options: LoadOptions):
    import torch
    from litdata import StreamingDataLoader, StreamingDataset

    torch.set_num_threads(1)
    dataset = StreamingDataset(str(options.data / "chunks"), shuffle=True, seed=options.seed,
                               transform=_Augment(options.image_size, options.seed))
    batches = StreamingDataLoader(dataset, batch_size=options.batch_size, num_workers=options.workers,
                                  persistent_workers=options.workers > 0)
    return lambda epoch: batches


def notes(options: LoadOptions) -> dict:
    return {"workers": f"{options.workers} worker processes (StreamingDataLoader, persistent)",
            "storage": "chunk files of 64 MB at most, read in place (page cache)",
            "shuffle": "the chunks, then the items within a chunk in windows (litdata's item_shuffle_window)",
            "decode": "Pillow (plain), full-size decode, crop, bilinear resize (antialiased)",
            "last_batch": "kept"}


def versions() -> dict:
    import importlib.metadata as metadata

    return {"litdata": metadata.version("litdata"), "pillow": metadata.version("pillow")}


PEER = Peer("litdata", pack, records, loader, notes, versions,
            modules=("litdata", "torch"))

if __name__ == "__main__":
    raise SystemExit(main(PEER))
