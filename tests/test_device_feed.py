"""The device feed: batches staged ahead of the step (by a thread on a GPU), yet its position is the
batches handed over."""

import pytest
import torch

from dimd.shuffle import BatchLoader
from dimd.shuffle.device_feed import DeviceFeed


def labels_of(batches):
    return [labels.tolist() for _, labels in batches]


#: 0: staged in the step's thread (the CPU's default); 2: by a feeding thread, two batches ahead (a GPU's)
AHEAD = pytest.mark.parametrize("ahead", [0, 2])


@AHEAD
def test_the_feed_hands_over_the_loaders_batches_in_order(store, ahead):
    with BatchLoader(store, batch_size=6, image_size=24, seed=2) as loader:
        expected = [(images.clone(), labels.clone()) for images, labels in loader.epoch(1)]
    feed = DeviceFeed(BatchLoader(store, batch_size=6, image_size=24, seed=2), torch.device("cpu"), ahead=ahead)
    fed = [(images.clone(), labels) for images, labels in feed.epoch(1)]
    feed.close()
    assert len(fed) == len(expected) == feed.steps_per_epoch
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fed, expected))
    assert feed.position == (2, 0)


@AHEAD
def test_a_feed_stopped_mid_epoch_continues_from_the_last_batch_it_handed_over(store, ahead):
    loader = BatchLoader(store, batch_size=4, image_size=24, seed=7)
    expected = labels_of(loader.epoch(0))
    loader.seek(0)
    feed = DeviceFeed(loader, torch.device("cpu"), ahead=ahead)
    batches = feed.epoch(0)
    first = [next(batches) for _ in range(3)]
    # the feeding thread may have taken batches ahead; the feed counts what the step got
    assert feed.position == (0, 3) and loader.position[1] >= 3
    state = feed.state_dict()
    assert (state["epoch"], state["step"]) == (0, 3)
    batches.close()
    assert loader.position == (0, 3)
    rest = list(feed.epoch(0))
    assert labels_of(first) + labels_of(rest) == expected

    again = DeviceFeed(BatchLoader(store, batch_size=4, image_size=24, seed=7), torch.device("cpu"), ahead=ahead)
    again.load_state_dict(state)
    assert labels_of(again.epoch(0)) == expected[3:]
    feed.close()
    again.close()


def test_a_loader_error_in_the_feeding_thread_reaches_the_step(store):
    loader = BatchLoader(store, batch_size=4, image_size=16, seed=1)

    def failing(epoch):
        yield from loader.epoch(epoch, stop=2)
        raise RuntimeError("record 17 does not decode")

    batches = DeviceFeed(loader, torch.device("cpu"), source=failing, ahead=2).epoch(0)
    assert len([next(batches), next(batches)]) == 2
    with pytest.raises(RuntimeError, match="record 17"):
        next(batches)
    loader.close()


def test_the_feed_stages_every_batch_through_its_stage(store):
    staged = []

    def stage(batch):
        staged.append(batch[1].tolist())
        return batch[0].float(), batch[1]

    with BatchLoader(store, batch_size=8, image_size=16, seed=1) as loader:
        fed = list(DeviceFeed(loader, torch.device("cpu"), stage=stage).epoch(0))
    assert all(images.dtype == torch.float32 for images, _ in fed)
    assert staged == labels_of(fed)
