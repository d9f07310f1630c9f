"""Runs that would train nothing are refused with one line; progress shows a slow rate as it is."""

from __future__ import annotations

import io

from conftest import invoke_dimd, run_dimd

from dimd.console import format_rate, progress


def test_more_sma_learners_than_batches_per_epoch_is_refused_not_a_silent_done(packed_sample):
    """48 records in batches of 4: 12 per epoch on one rank; 13 learners would never take a step."""
    proc = run_dimd("train", packed_sample, "--val", packed_sample, "--model", "lenet", "--image-size", "32",
                    "--batch-size", "4", "--sync", "sma", "--learners", "13", "--epochs", "1", "--device", "cpu",
                    "--decode-workers", "1", timeout=180)
    assert proc.returncode == 1, proc.stdout
    assert "--learners 13 per rank take 13 batches per step, but a rank has 12 batches of 4 per epoch" in proc.stderr
    assert "done" not in proc.stdout


def test_a_rate_below_one_per_second_keeps_its_digits():
    assert format_rate(0.42) == "0.42" and format_rate(3.0) == "3" and format_rate(1234.5) == "1,234"
    log = io.StringIO()
    with progress(10, "train", unit="step", stream=log) as advance:
        advance(1)
    assert log.getvalue().endswith("\n") and " 0 step/s" not in log.getvalue()


def test_tensorboard_without_its_extra_is_refused_in_one_line_before_the_data_loads(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    proc = invoke_dimd("train", tmp_path / "missing", "--val", tmp_path / "missing", "--tensorboard", tmp_path / "tb")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "dimd: error: --tensorboard needs the tensorboard extra: `make tensorboard-setup` installs tensorboard "
        "without the plain Pillow it asks for, and dimd[tensorboard] its other dependencies"]
