#!/usr/bin/env python
"""FFCV 1.0.2 (build/peers/ffcv): one .beton file, numba-compiled pipelines, libturbojpeg + OpenCV.

pack    ``DatasetWriter(..., num_workers=N).from_indexed_dataset`` with an ``RGBImageField``
        in 'jpg' mode and an ``IntField``. The image field is given the manifest's JPEG
        bytes as they are (its encode writes mode, height, width and the bytes): FFCV's
        own encode would decode them and re-encode with OpenCV (and ``max_resolution``
        caps the long side, not the short one), so its decoder would get other images
        than every other loader. FFCV keeps no names: sample i is manifest record i,
        and ``names.txt`` records that order for verify.
verify  the raw bytes of every sample, found through the file's allocation table.
load    ``Loader(order=RANDOM, os_cache=True, num_workers=N)`` with FFCV's ImageNet
        training pipeline: ``RandomResizedCropRGBImageDecoder((S, S))``,
        ``RandomHorizontalFlip()``, ``ToTensor()``, ``ToTorchImage()`` (uint8, N x 3 x S x S
        in channels-last memory); labels ``IntDecoder()``, ``ToTensor()``, ``Squeeze()``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from _peer import LoadOptions, Manifest, Peer, main

BETON = "train.beton"


class SameBytes:
    """An indexable dataset of (JPEG bytes + size, label): what the writer's workers read."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest

    def __len__(self) -> int:
        return len(self.manifest.records)

    def __getitem__(self, i: int):
        r = self.manifest.records[i]
        return (self.manifest.data(r), r.height, r.width), r.label


def _store_as_is(destination, item, malloc) -> None:
    """RGBImageField.encode for bytes that are already the JPEG to store."""
    from ffcv.fields.rgb_image import IMAGE_MODES

    data, height, width = item
    destination["mode"] = IMAGE_MODES["jpg"]
    destination["height"], destination["width"] = height, width
    destination["data_ptr"], storage = malloc(len(data))
    storage[:] = np.frombuffer(data, np.uint8)


def pack(manifest: Manifest, out: Path, workers: int) -> dict:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    image = RGBImageField(write_mode="jpg")
    image.encode = _store_as_is   # the writer's workers are forked: the instance keeps it
    writer = DatasetWriter(str(out / BETON), {"image": image, "label": IntField()}, num_workers=workers)
    writer.from_indexed_dataset(SameBytes(manifest))
    (out / "names.txt").write_text("".join(f"{r.name}\n" for r in manifest.records))
    return {"processes": workers}


def records(data: Path):
    from ffcv.reader import Reader

    reader = Reader(str(data / BETON))
    names = (data / "names.txt").read_text().splitlines()
    if len(names) != reader.num_samples:
        raise SystemExit(f"{data}: {reader.num_samples} samples but {len(names)} names")
    sizes = dict(zip(reader.alloc_table["ptr"].tolist(), reader.alloc_table["size"].tolist()))
    raw = np.memmap(str(data / BETON), np.uint8, mode="r")
    # the metadata's columns are f0, f1, ... in the order of the fields
    images = reader.metadata[f"f{reader.field_names.index('image')}"]
    labels = reader.metadata[f"f{reader.field_names.index('label')}"]
    for i, name in enumerate(names):
        pointer = int(images["data_ptr"][i])
        if int(images["mode"][i]) != 0:
            raise SystemExit(f"{data}: sample {i} is not stored as JPEG")
        yield name, int(labels[i]), raw[pointer:pointer + sizes[pointer]].tobytes()


def loader(options: LoadOptions):
    import torch
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    torch.set_num_threads(1)
    size = options.image_size
    pipelines = {"image": [RandomResizedCropRGBImageDecoder((size, size)), RandomHorizontalFlip(), ToTensor(),
                           ToTorchImage()],
                 "label": [IntDecoder(), ToTensor(), Squeeze()]}
    batches = Loader(str(options.data / BETON), batch_size=options.batch_size, num_workers=options.workers,
                     order=OrderOption.RANDOM, os_cache=True, seed=options.seed, pipelines=pipelines)
    return lambda epoch: batches


def notes(options: LoadOptions) -> dict:
    return {"workers": f"{options.workers} threads (numba's parallel loops) in the training process, "
                       f"up to 3 batches ahead",
            "storage": "the .beton file memory-mapped (page cache: os_cache=True)",
            "shuffle": "a permutation of the whole set every epoch (OrderOption.RANDOM)",
            "decode": "libturbojpeg full-size decode, OpenCV crop + resize (INTER_AREA)",
            "last_batch": "dropped (drop_last=True, FFCV's default)"}


def versions() -> dict:
    import importlib.metadata as metadata

    return {name: metadata.version(name) for name in ("ffcv", "numba", "opencv-python", "pillow")}


PEER = Peer("ffcv", pack, records, loader, notes, versions,
            modules=("ffcv.writer", "ffcv.fields", "ffcv.loader", "ffcv.reader", "torch"))

if __name__ == "__main__":
    raise SystemExit(main(PEER))
