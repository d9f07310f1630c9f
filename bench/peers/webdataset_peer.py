#!/usr/bin/env python
"""webdataset 1.0.2 (build/peers/webdataset): tar shards read as streams by DataLoader workers.

pack    ``ShardWriter`` (one process: it has no workers) writes the manifest's JPEG bytes
        as ``KEY.jpg`` and the label as ``KEY.cls`` into SHARDS tar files, KEY being the
        record's name without its extension.
verify  every shard read in order, undecoded.
load    ``WebDataset(shards, shardshuffle=SHARDS, detshuffle=True, seed=K)`` (shards split
        between the workers, then shuffled), ``.shuffle(1000)`` (a window of 1000
        samples), ``.decode("pil")``, the augmentation (torchvision's RandomResizedCrop +
        flip + PILToTensor, written with Pillow: bench/peers/_peer.py; there is no
        torchvision next to a CPU torch), ``.batched(B)`` in the workers, and a
        ``WebLoader(batch_size=None, num_workers=N, persistent_workers=True)``.
"""

from __future__ import annotations

from pathlib import Path

from _peer import LoadOptions, Manifest, Peer, WorkerRng, main, pil_train_sample

SHARDS = 8     # a multiple of the 2 workers, so each reads the same share
PATTERN = "shard-%06d.tar"


def _key(name: str) -> str:
    stem, dot, _ = name.rpartition(".")
    return stem if dot else name


def pack(manifest: Manifest, out: Path, workers: int) -> dict:
    import webdataset as wds

    per_shard = -(-len(manifest.records) // SHARDS)
    with wds.ShardWriter(str(out / PATTERN), maxcount=per_shard, verbose=0) as sink:
        for r in manifest.records:
            sink.write({"__key__": _key(r.name), "jpg": manifest.data(r), "cls": r.label})
    return {"processes": 1, "shards": len(shards(out))}


def shards(data: Path) -> list[str]:
    return sorted(str(p) for p in data.glob("shard-*.tar"))


def records(data: Path):
    import webdataset as wds

    for sample in wds.WebDataset(shards(data), shardshuffle=False):
        yield sample["__key__"], int(sample["cls"]), sample["jpg"]


def loader(options: LoadOptions):
    import torch
    import webdataset as wds

    torch.set_num_threads(1)
    urls = shards(options.data)
    rng, size = WorkerRng(options.seed), options.image_size
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), detshuffle=True, seed=options.seed)
               .shuffle(1000)
               .decode("pil")
               .to_tuple("jpg", "cls")
               .map_tuple(lambda image: pil_train_sample(image, size, rng()), int)
               .batched(options.batch_size, partial=True))
    batches = wds.WebLoader(dataset, batch_size=None, num_workers=options.workers,
                            persistent_workers=options.workers > 0)
    return lambda epoch: batches


def notes(options: LoadOptions) -> dict:
    return {"workers": f"{options.workers} worker processes (torch DataLoader, persistent), each streaming "
                       f"its share of the {SHARDS} shards; batches made in the workers",
            "storage": "tar files read sequentially (page cache)",
            "shuffle": "the shards, then a window of 1000 samples in each worker",
            "decode": "Pillow (plain), full-size decode, crop, bilinear resize (antialiased)",
            "last_batch": "kept (each worker's last batch may be short)"}


def versions() -> dict:
    import importlib.metadata as metadata

    return {"webdataset": metadata.version("webdataset"), "pillow": metadata.version("pillow")}


PEER = Peer("webdataset", pack, records, loader, notes, versions,
            modules=("webdataset", "torch"))

if __name__ == "__main__":
    raise SystemExit(main(PEER))
