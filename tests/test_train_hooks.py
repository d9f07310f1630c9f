"""The engine's hooks for time-to-accuracy: evaluations every N training images, a stop at a target."""

import pytest


def config(data, **changes):
    from dimd.train.config import TrainConfig

    settings = dict(train=str(data), val=str(data), model="lenet", image_size=32, epochs=2, batch_size=8,
                    lr=0.01, lr_scaling=False, schedule="constant", decode_workers=1, threads=1)
    return TrainConfig(**{**settings, **changes})


@pytest.mark.parametrize("sync", ["ssgd", "sma"])
def test_evaluations_every_n_images_besides_epoch_ends(packed_sample, world, sync):
    from dimd.train.engine import train

    from dimd.train.config import SMAConfig

    extra = {"sync": "sma", "sma": SMAConfig(learners=2)} if sync == "sma" else {}
    result = train(config(packed_sample, **extra), world, eval_every_images=20)
    # 48 images per epoch (S-SGD: 6 steps of 8; SMA: 3 steps of 2 learners x 8): an evaluation at the
    # first step reaching 20, 40, 60... images, and at every epoch end (which counts as the one due)
    expected = [24, 40, 48, 64, 80, 96] if sync == "ssgd" else [32, 48, 64, 80, 96]
    assert [e.images for e in result.evaluations] == expected
    assert [round(e.epoch, 3) for e in result.evaluations][-1] == 2.0
    assert all(0 <= e.top1 <= 1 and e.elapsed > 0 for e in result.evaluations)
    assert result.stopped_by is None and len(result.epochs) == 2
    memory = result.figures()["memory_per_rank"][0]   # the rank and its one decoding worker, the store once
    assert memory["workers"] == 1 and memory["total"] == memory["rank_pss"] + memory["workers_pss"] > 0


def test_a_target_accuracy_ends_the_run_at_the_first_evaluation_reaching_it(packed_sample, world):
    from dimd.train.engine import Hooks, train

    events = []
    result = train(config(packed_sample, epochs=5), world, eval_every_images=16, target_top1=0.0,
                   hooks=Hooks(on_event=events.append))
    assert result.stopped_by == "target" and len(result.evaluations) == 1 and result.evaluations[0].images == 16
    assert result.epochs == [] and any("reaches the target" in e for e in events)
