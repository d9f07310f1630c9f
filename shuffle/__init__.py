"""In-memory data: partitioned load, the store, batch sampling, decode/augment, group shuffle.

    from dimd.shuffle import DistributedStore, BatchLoader
    store = DistributedStore.load("/scratch/in1k/train", comm, groups=1)
    loader = BatchLoader(store, batch_size=64, image_size=224, train=True, workers=4)
    for epoch in range(epochs):
        store.shuffle(seed, round=epoch)
        for images, labels in loader.epoch(epoch):
            ...
"""

from dimd.shuffle.decode import DecodeError, decode_eval, decode_train
from dimd.shuffle.loader import BatchLoader
from dimd.shuffle.store import DistributedStore, LoadStats, ShuffleStats

__all__ = ["BatchLoader", "DecodeError", "DistributedStore", "LoadStats", "ShuffleStats",
           "decode_eval", "decode_train"]
