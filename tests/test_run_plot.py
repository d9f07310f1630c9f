"""`dimd plot`: training runs' metrics files as one figure; a file that is not one is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import invoke_dimd


def metrics_file(path: Path, epochs: int, rate: float) -> Path:
    """A `dimd train --metrics` file as the run writes it, one line per epoch."""
    from dimd.train.results import EpochMetrics, metrics_line

    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [metrics_line(EpochMetrics(epoch=e, step=10 * e, lr=0.1, train_loss=2 / e, train_top1=1 - 1 / (e + 1),
                                       val_loss=2.2 / e, val_top1=1 - 1.2 / (e + 1), val_top5=1.0, images=160,
                                       images_per_s=rate, seconds=1.0, train_seconds=0.8, eval_seconds=0.1,
                                       shuffle_seconds=0.1, time_split={}, elapsed=3.0 + e * 160 / rate), "run")
             for e in range(1, epochs + 1)]
    path.write_text("".join(lines))
    return path


def test_plot_draws_several_runs_on_one_png_named_by_their_folders(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from dimd.run_plot import read_runs

    files = [metrics_file(tmp_path / "ssgd" / "metrics.jsonl", 6, 200.0),
             metrics_file(tmp_path / "sma" / "metrics.jsonl", 4, 150.0)]
    assert [run.label for run in read_runs(files, [])] == ["ssgd", "sma"]
    proc = invoke_dimd("plot", *files, "-o", tmp_path / "run.png", check=True)
    assert proc.stdout.strip() == f"wrote {tmp_path / 'run.png'}: 2 run(s), 10 epochs"
    with Image.open(tmp_path / "run.png") as png:
        assert png.format == "PNG" and png.size[0] > png.size[1] > 600


def test_plot_labels_runs_as_told(tmp_path):
    from dimd.run_plot import read_runs

    files = [metrics_file(tmp_path / "a.jsonl", 2, 10.0), metrics_file(tmp_path / "b.jsonl", 2, 10.0)]
    assert [run.label for run in read_runs(files, ["S-SGD"])] == ["S-SGD", "b"]
    assert read_runs(files, [])[1].column("val_top1") == pytest.approx([0.4, 0.6])


def test_plot_refuses_a_file_that_is_no_metrics_file_in_one_line(tmp_path):
    (tmp_path / "train.json").write_text('{"command": "train"}\n')
    proc = invoke_dimd("plot", tmp_path / "train.json", "-o", tmp_path / "run.png")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"dimd: error: {tmp_path / 'train.json'}:1: no 'epoch': not a `dimd train --metrics` line"]
    assert not (tmp_path / "run.png").exists()
