"""Learning-rate rules: linear scaling, warm-up, step, poly, cosine at chosen steps."""

import math

import pytest

from dimd.train.schedule import (Schedule, cosine_lr, default_milestones, default_warmup_epochs,
                                 make_schedule, poly_lr, scaled_lr, step_lr, warmup_lr)


def test_linear_scaling_rule():
    assert scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert scaled_lr(0.1, 8192) == pytest.approx(3.2)      # Goyal et al.: 32 x 0.1
    assert scaled_lr(0.1, 8192, scaling=False) == 0.1


def test_warmup_defaults_follow_goyal():
    assert default_warmup_epochs(256) == 0
    assert default_warmup_epochs(512) == 5


def test_default_milestones_are_30_60_80_of_90():
    assert default_milestones(90) == (30, 60, 80)
    assert default_milestones(9) == (3, 6, 8)
    assert default_milestones(1) == ()


def test_pure_rules():
    assert warmup_lr(0, 10, 0.1, 1.1) == pytest.approx(0.1)
    assert warmup_lr(5, 10, 0.1, 1.1) == pytest.approx(0.6)
    assert warmup_lr(10, 10, 0.1, 1.1) == pytest.approx(1.1)
    assert step_lr(1.0, 29.9, (30, 60, 80)) == pytest.approx(1.0)
    assert step_lr(1.0, 30, (30, 60, 80)) == pytest.approx(0.1)
    assert step_lr(1.0, 85, (30, 60, 80)) == pytest.approx(0.001)
    assert poly_lr(0.08, 0.75) == pytest.approx(0.04)      # FireCaffe: (1 - 3/4)^0.5 = 1/2
    assert cosine_lr(1.0, 0.5) == pytest.approx(0.5)
    assert cosine_lr(1.0, 1.0) == pytest.approx(0.0)


def test_resnet50_recipe_with_warmup():
    # DIMD paper set-up: 64 images per GPU on 128 GPUs, lr 0.1 for 256, 5 warm-up epochs, /10 at 30/60/80.
    s = make_schedule("step", 0.1, global_batch=64 * 128, steps_per_epoch=100, epochs=90)
    assert s.peak_lr == pytest.approx(3.2)
    assert s.warmup_steps == 500
    assert s.lr(0) == pytest.approx(0.1)
    assert s.lr(250) == pytest.approx(0.1 + (3.2 - 0.1) / 2)
    assert s.lr(500) == pytest.approx(3.2)
    assert s.lr(2999) == pytest.approx(3.2)
    assert s.lr(3000) == pytest.approx(0.32)
    assert s.lr(8999) == pytest.approx(0.0032)


def test_poly_and_cosine_decay_from_the_end_of_warmup():
    poly = Schedule("poly", 1.0, steps_per_epoch=10, epochs=10, warmup_epochs=2, warmup_start_lr=0.5)
    assert poly.lr(0) == pytest.approx(0.5)
    assert poly.lr(20) == pytest.approx(1.0)
    assert poly.lr(60) == pytest.approx(math.sqrt(0.5))
    assert poly.lr(100) == pytest.approx(0.0)
    cos = Schedule("cosine", 2.0, steps_per_epoch=10, epochs=3)
    assert cos.lr(15) == pytest.approx(1.0)


def test_small_batch_has_no_warmup_and_constant_is_constant():
    s = make_schedule("constant", 0.4, global_batch=64, steps_per_epoch=12, epochs=8)
    assert s.warmup_steps == 0
    assert [s.lr(i) for i in range(s.total_steps)] == pytest.approx([0.1] * s.total_steps)


def test_warmup_of_a_small_batch_starts_from_a_tenth():
    s = make_schedule("cosine", 0.4, global_batch=64, steps_per_epoch=12, epochs=8, warmup_epochs=1)
    assert s.peak_lr == pytest.approx(0.1) and s.warmup_steps == 12
    assert s.lr(0) == pytest.approx(0.01)
    assert s.lr(6) == pytest.approx(0.055)
    assert s.lr(12) == pytest.approx(0.1)


def test_unknown_schedule_is_rejected():
    with pytest.raises(ValueError, match="unknown schedule"):
        Schedule("linear", 1.0, steps_per_epoch=1, epochs=1)  # type: ignore[arg-type]
