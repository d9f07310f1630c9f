#!/usr/bin/env python
"""dimd as one of the loaders (run with dimd's own .venv): bench/peers/_peer.py's three commands.

pack    the manifest's JPEG bytes into dimd's format with ``dimd.format.PackWriter`` (one
        process: writing needs no decode; ``dimd pack`` of the original tree, which also
        resizes, is timed by bench/peer_loaders.py itself);
verify  the records as ``dimd.format.PackedDataset`` reads them;
load    ``dimd.shuffle.BatchLoader`` over the records held in this process's memory
        (``DistributedStore`` on one rank): ``--workers`` decoding processes, the crop's region
        decoded alone (DCT-domain draft scale), a permutation of the whole set each epoch.
"""

from __future__ import annotations

from pathlib import Path

from _peer import LoadOptions, Manifest, Peer, main

STEM = "train"


def pack(manifest: Manifest, out: Path, workers: int) -> dict:
    from dimd.format import PackedRecord, PackWriter

    with PackWriter(out / STEM, force=True) as writer:
        for r in manifest.records:
            writer.add(PackedRecord(manifest.data(r), r.label, r.name, r.height, r.width))
        writer.commit(manifest.classes, short_side=256, quality=90, source=str(manifest.files))
    return {"processes": 1}


def records(data: Path):
    from dimd.format import PackedDataset

    packed = PackedDataset(data / STEM)
    for i, name in enumerate(packed.names):
        yield name, int(packed.labels[i]), bytes(packed.record(i))


def loader(options: LoadOptions):
    from dimd.mpi import init_mpi

    init_mpi("funneled")   # only this thread calls MPI; the decoding workers are processes without MPI
    from mpi4py import MPI

    from dimd.shuffle.loader import BatchLoader
    from dimd.shuffle.store import DistributedStore

    import torch

    torch.set_num_threads(1)
    store = DistributedStore.load(options.data / STEM, MPI.COMM_WORLD)
    batches = BatchLoader(store, options.batch_size, options.image_size, train=True,
                          decode_workers=options.workers, seed=options.seed)
    return batches.epoch


def notes(options: LoadOptions) -> dict:
    return {"workers": f"{options.workers} decoding worker processes, started once",
            "storage": "the records in the process's shared-memory segment (read once from the .dimd file), "
                       "read zero-copy by the workers",
            "shuffle": "a permutation of the whole set every epoch",
            "decode": "libjpeg-turbo decode of the crop's region only, at the smallest DCT scale that keeps "
                      "the crop at least the output size; crop and resize in one pillow-simd bilinear resize",
            "last_batch": "dropped (every batch full)"}


def versions() -> dict:
    import importlib.metadata as metadata

    return {"dimd": metadata.version("dimd"), "pillow-simd": metadata.version("pillow-simd")}


PEER = Peer("dimd", pack, records, loader, notes, versions,
            modules=("dimd.format", "dimd.shuffle.loader", "h5py", "torch"))

if __name__ == "__main__":
    raise SystemExit(main(PEER))
