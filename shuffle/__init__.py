"""In-memory data: partitioned load, the store, batch sampling, decode/augment, group shuffle.

    from dimd.shuffle import DistributedStore, BatchLoader
    store = DistributedStore.load("/scratch/in1k/train", comm, groups=1)
    loader = BatchLoader(store, batch_size=64, image_size=224, train=True, workers=4)
    for epoch in range(epochs):
        store.shuffle(seed, round=epoch)
        for images, labels in loader.epoch(epoch):
            ...
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dimd.shuffle.decode import DecodeError, decode_eval, decode_train
    from dimd.shuffle.loader import BatchLoader
    from dimd.shuffle.store import DistributedStore, LoadStats, ShuffleStats

#: What ``from dimd.shuffle import X`` offers, and the module each name lives in. Loaded on first
#: use, so a decoding worker process (``dimd.shuffle.decode_worker``) imports only what it runs.
_EXPORTS = {"BatchLoader": "loader", "DecodeError": "decode", "DistributedStore": "store",
            "LoadStats": "store", "ShuffleStats": "store", "decode_eval": "decode", "decode_train": "decode"}

__all__ = ["BatchLoader", "DecodeError", "DistributedStore", "LoadStats", "ShuffleStats",
           "decode_eval", "decode_train"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dimd.shuffle' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dimd.shuffle.{_EXPORTS[name]}"), name)
