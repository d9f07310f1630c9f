"""The device feed: one batch ahead of the step, yet its position is the batches handed over."""

import torch

from dimd.shuffle import BatchLoader
from dimd.train.device_feed import DeviceFeed


def labels_of(batches):
    return [labels.tolist() for _, labels in batches]


def test_the_feed_hands_over_the_loaders_batches_in_order(store):
    with BatchLoader(store, batch_size=6, image_size=24, seed=2) as loader:
        expected = [(images.clone(), labels.clone()) for images, labels in loader.epoch(1)]
    feed = DeviceFeed(BatchLoader(store, batch_size=6, image_size=24, seed=2), torch.device("cpu"))
    fed = list(feed.epoch(1))
    feed.close()
    assert len(fed) == len(expected) == feed.steps_per_epoch
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fed, expected))
    assert feed.position == (2, 0)


def test_a_feed_stopped_mid_epoch_continues_from_the_last_batch_it_handed_over(store):
    loader = BatchLoader(store, batch_size=4, image_size=24, seed=7)
    expected = labels_of(loader.epoch(0))
    loader.seek(0)
    feed = DeviceFeed(loader, torch.device("cpu"))
    batches = feed.epoch(0)
    first = [next(batches) for _ in range(3)]
    # the loader has given out a fourth batch already; the feed counts what the step got
    assert loader.position == (0, 4) and feed.position == (0, 3)
    state = feed.state_dict()
    assert (state["epoch"], state["step"]) == (0, 3)
    batches.close()
    assert loader.position == (0, 3)
    rest = list(feed.epoch(0))
    assert labels_of(first) + labels_of(rest) == expected

    again = DeviceFeed(BatchLoader(store, batch_size=4, image_size=24, seed=7), torch.device("cpu"))
    again.load_state_dict(state)
    assert labels_of(again.epoch(0)) == expected[3:]
    feed.close()
    again.close()


def test_the_feed_stages_every_batch_through_its_stage(store):
    staged = []

    def stage(batch):
        staged.append(batch[1].tolist())
        return batch[0].float(), batch[1]

    with BatchLoader(store, batch_size=8, image_size=16, seed=1) as loader:
        fed = list(DeviceFeed(loader, torch.device("cpu"), stage=stage).epoch(0))
    assert all(images.dtype == torch.float32 for images, _ in fed)
    assert staged == labels_of(fed)
