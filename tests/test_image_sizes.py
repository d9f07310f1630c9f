"""Progressive resizing's schedule: the training crop of each epoch, in the model's steps, checked once."""

import pytest

from dimd.errors import ConfigError, DimdError
from dimd.train.image_sizes import SizeSchedule, parse_size_schedule, size_step


def test_a_resnet50_ramp_grows_in_steps_of_32_px_between_its_two_epochs():
    schedule = parse_size_schedule("128:192:10:14", model="resnet50", epochs=16)
    # 128 + 64 * (e - 10) / 4 px for e in 11..13: 144, 160, 176, each to the nearest 32 (halves up)
    assert [schedule.size(epoch) for epoch in range(16)] == [128] * 11 + [160, 160, 192, 192, 192]
    assert schedule.largest == 192 and schedule.sizes(16) == [128, 160, 192]
    ffcv = parse_size_schedule("160:192:10:12", model="resnet50", epochs=16)   # FFCV's 160 -> 192 px
    assert ffcv.sizes(16) == [160, 192] and ffcv.size(10) == 160 and ffcv.size(11) == 192


def test_without_epochs_the_ramp_spans_the_run_rounded_to_the_nearest_step():
    schedule = parse_size_schedule("16:32", model="resnet20", epochs=5)
    assert schedule == SizeSchedule(start=16, end=32, first=0, last=4, step=8)
    # 16 + 16 * e / 4 px: 16, 20, 24, 28, 32; halves round up to the next step of 8
    assert [schedule(epoch) for epoch in range(5)] == [16, 24, 24, 32, 32]


def test_a_fixed_size_is_a_schedule_too():
    schedule = parse_size_schedule("32:32", model="resnet20", epochs=3)
    assert [schedule(epoch) for epoch in range(3)] == [32, 32, 32] and schedule.sizes(3) == [32]


def test_the_step_follows_the_models_design_size():
    assert size_step("resnet50") == size_step("resnet18") == size_step("googlenet-bn") == 32
    assert size_step("resnet20") == size_step("lenet") == size_step("vgg16") == 8
    assert size_step("my_net.py:build") == 8   # a user's model: its strides are unknown, the finer step


@pytest.mark.parametrize("text, problem", [
    ("192:160", "must not shrink: START 192 px is above END 160 px"),
    ("160:200", "must be in steps of 32 px for resnet50: 200 px is not a multiple of 32"),
    ("150:192", "must be in steps of 32 px for resnet50: 150 px is not a multiple of 32"),
    ("160:192:12:10", "needs 0 <= FIRST <= LAST epochs"),
    ("160:192:10:16", "ends its ramp at epoch 16, after the run's last epoch (15, counted from 0)"),
    ("160-192", "must be START:END or START:END:FIRST:LAST in px and epochs"),
    ("160:192:10", "must be START:END or START:END:FIRST:LAST"),
    ("0:192", "must start at 32 px at least for resnet50"),
])
def test_a_schedule_that_cannot_run_is_refused_in_one_line_naming_the_field(text, problem):
    with pytest.raises(ConfigError) as refused:
        parse_size_schedule(text, model="resnet50", epochs=16)
    assert refused.value.field == "image_size_schedule"
    assert str(refused.value).startswith(f"image_size_schedule {problem}") and "\n" not in str(refused.value)


def test_a_start_below_what_the_models_pooling_takes_is_refused():
    with pytest.raises(ConfigError, match=r"must be at least 16 for lenet \(got '8:32'\)"):
        parse_size_schedule("8:32", model="lenet", epochs=4)


def test_a_schedule_ending_past_the_packed_short_side_is_refused_naming_the_flag():
    schedule = parse_size_schedule("160:256", model="resnet50", epochs=16)
    schedule.check_short_side(256, "train")
    with pytest.raises(DimdError) as refused:
        schedule.check_short_side(240, "train")
    assert str(refused.value) == ("`image_size_schedule` ends at 256 px, past the packed short side of train "
                                  "(240 px); end at 224 px or pack with a larger --short-side")
