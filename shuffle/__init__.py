"""The data path: a packed set held in memory across the ranks, up to normalised batches on the device.

    from dimd.shuffle import DistributedStore, BatchLoader
    store = DistributedStore.load("/scratch/in1k/train", comm, groups=1)
    loader = BatchLoader(store, batch_size=64, image_size=224, train=True, decode_workers=4)
    for epoch in range(epochs):
        store.shuffle(seed, round=epoch)
        for images, labels in loader.epoch(epoch):
            ...

(``open_loader`` does the load, the first shuffle and the loader in one call.)
The modules, in the order a batch meets them:

- the set in memory: ``store`` (``DistributedStore``: the partitioned load,
  zero-copy records, the group shuffle), ``partition`` (groups, shares, the
  memory check), ``exchange`` (the Alltoallv behind a shuffle), ``shm`` (the
  anonymous segment a rank and its decoding workers map), ``memory`` (a
  rank's memory, the shared store counted once);
- batches: ``loader`` (``BatchLoader``: the sampler and the ring of batch
  slots; ``open_loader``), ``streams`` (one random stream per purpose),
  ``workers`` and ``decode_worker`` (the decoding processes), ``decode`` and
  ``crop`` (JPEG decode and augmentation), ``pinned`` (the ring page-locked
  for a GPU's copy), ``filesource`` (``--read-from files``: records read from
  their original files, the baseline);
- onto the device: ``device_feed`` (``DeviceFeed``: a thread stages batches
  ahead of the step), ``raw_batches`` and ``gpu_decode`` (``--decode gpu``,
  nvJPEG), ``normalize`` (uint8 -> normalised float32 on the device);
- the commands' work: ``rounds`` (``dimd shuffle``), ``verify`` (the
  conservation check), ``bench_io`` (``dimd bench-io``).

The package imports only dimd's core (``tests/test_layering.py``): training
builds on it, never the reverse.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dimd.shuffle.decode import DecodeError, decode_eval, decode_train
    from dimd.shuffle.device_feed import DeviceFeed
    from dimd.shuffle.loader import BatchLoader, open_loader
    from dimd.shuffle.normalize import Normalize
    from dimd.shuffle.store import DistributedStore, LoadStats, ShuffleStats

#: What ``from dimd.shuffle import X`` offers, and the module each name lives in. Loaded on first
#: use, so a decoding worker process (``dimd.shuffle.decode_worker``) imports only what it runs.
_EXPORTS = {"BatchLoader": "loader", "DecodeError": "decode", "DeviceFeed": "device_feed",
            "DistributedStore": "store", "LoadStats": "store", "Normalize": "normalize", "ShuffleStats": "store",
            "decode_eval": "decode", "decode_train": "decode", "open_loader": "loader"}

__all__ = ["BatchLoader", "DecodeError", "DeviceFeed", "DistributedStore", "LoadStats", "Normalize",
           "ShuffleStats", "decode_eval", "decode_train", "open_loader"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dimd.shuffle' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dimd.shuffle.{_EXPORTS[name]}"), name)
