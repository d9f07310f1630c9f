#!/usr/bin/env python
"""torchvision's ImageFolder + torch's DataLoader over one file per image (build/peers/torchvision).

pack    the manifest's JPEG bytes as one file each, in the class tree ImageFolder reads
        (what "no format at all" costs to write);
verify  the files as ImageFolder lists them (labels from its sorted class folders);
load    ``ImageFolder(root, transform=Compose([RandomResizedCrop(S), RandomHorizontalFlip(),
        PILToTensor()]))`` in a ``DataLoader(shuffle=True, num_workers=N,
        persistent_workers=True)``: N worker processes, each opening, reading and decoding
        its files (page cache), a permutation of the whole set each epoch. ``--data`` may
        be the short-side-256 files or the original tree (then every image is decoded at
        its original size, as a user who never packs would).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from _peer import LoadOptions, Manifest, Peer, crop_resize, main, random_resized_crop_box


def pack(manifest: Manifest, out: Path, workers: int) -> dict:
    for r in manifest.records:
        target = out / r.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(manifest.files / r.name, target)
    return {"processes": 1}


def records(data: Path):
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(str(data))
    for path, label in folder.samples:
        yield str(Path(path).relative_to(data)), label, Path(path).read_bytes()


def loader(options: LoadOptions):
    import torch
    from torch.utils.data import DataLoader
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    torch.set_num_threads(1)
    transform = T.Compose([T.RandomResizedCrop(options.image_size), T.RandomHorizontalFlip(), T.PILToTensor()])
    folder = ImageFolder(str(options.data), transform=transform)
    batches = DataLoader(folder, batch_size=options.batch_size, shuffle=True, num_workers=options.workers,
                         persistent_workers=options.workers > 0,
                         generator=torch.Generator().manual_seed(options.seed))
    return lambda epoch: batches


def notes(options: LoadOptions) -> dict:
    return {"workers": f"{options.workers} worker processes (torch DataLoader, persistent), batches "
                       f"collated in the workers and sent to the training process through shared memory",
            "storage": "one file per image, opened and read on every access (page cache)",
            "shuffle": "a permutation of the whole set every epoch",
            "decode": "Pillow (plain), full-size decode, crop, bilinear resize (antialiased)",
            "last_batch": "kept (a short last batch)"}


def versions() -> dict:
    import torchvision

    return {"torchvision": torchvision.__version__}


def extra_checks(manifest: Manifest) -> dict:
    """The Pillow crop + resize the litdata and webdataset peers use, against torchvision's own."""
    import io

    import numpy as np
    from PIL import Image
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    rng, worst = np.random.default_rng(0), 0
    for r in manifest.records[:16]:
        image = Image.open(io.BytesIO(manifest.data(r))).convert("RGB")
        left, top, w, h = random_resized_crop_box(*image.size, rng)
        ours = np.asarray(crop_resize(image, (left, top, w, h), 224), np.int16)
        theirs = np.asarray(F.resized_crop(image, top, left, h, w, [224, 224], InterpolationMode.BILINEAR),
                            np.int16)
        worst = max(worst, int(np.abs(ours - theirs).max()))
    return {"pil_augmentation_max_difference_from_torchvision": worst}


PEER = Peer("torchvision", pack, records, loader, notes, versions, extra_checks,
            modules=("torchvision.datasets", "torchvision.transforms", "torch"))

if __name__ == "__main__":
    raise SystemExit(main(PEER))
