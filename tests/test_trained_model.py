"""After training: `dimd eval` scores a checkpoint as the run did, on the run's ranks or any others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import invoke_dimd, pack_tree_as_is, run_mpi_dimd

EPOCHS = 3


@pytest.fixture(scope="module")
def trained(colour_set, tmp_path_factory) -> Path:
    """resnet18 (torchvision's layout) trained for three epochs on 2 ranks, at 16 px: its last checkpoint and
    its metrics, in one folder."""
    out = tmp_path_factory.mktemp("trained")
    run_mpi_dimd(2, "train", colour_set, "--val", colour_set, "--model", "resnet18", "--image-size", "16",
                 "--epochs", str(EPOCHS), "--batch-size", "8", "--lr", "0.05", "--no-lr-scaling",
                 "--schedule", "constant", "--decode-workers", "1", "--threads", "1", "--allreduce", "ring",
                 "--checkpoint-dir", out / "checkpoints", "--keep-checkpoints", "1", "--metrics",
                 out / "metrics.jsonl", "-q", timeout=180, check=True)
    return out


def last_checkpoint(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("checkpoint-*.pt"))[-1]


def logged_epoch(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.mpi
def test_eval_on_the_runs_ranks_gives_the_logged_figures_to_the_image(trained, colour_set, tmp_path):
    run_mpi_dimd(2, "eval", last_checkpoint(trained), colour_set, "--threads", "1", "--decode-workers", "1",
                 "--json", tmp_path / "eval.json", timeout=120, check=True)
    result = json.loads((tmp_path / "eval.json").read_text())["result"]
    logged = logged_epoch(trained)
    assert result["epoch"] == logged["epoch"] == EPOCHS and result["samples"] == 48
    assert round(result["top1"] * 48) == round(logged["val_top1"] * 48)
    assert round(result["top5"] * 48) == round(logged["val_top5"] * 48)
    assert result["loss"] == pytest.approx(logged["val_loss"], rel=1e-6)
    assert result["logged"]["val_top1"] == logged["val_top1"]


def test_eval_on_one_rank_scores_rank_0s_model_with_each_class_apart(trained, colour_set, tmp_path):
    proc = invoke_dimd("eval", last_checkpoint(trained), colour_set, "--threads", "1", "--decode-workers", "1",
                       "--per-class", "--json", tmp_path / "eval.json", check=True)
    result = json.loads((tmp_path / "eval.json").read_text())["result"]
    rows = result["per_class"]
    assert [row["class"] for row in rows] == ["red", "green", "blue", "grey"]
    assert [row["samples"] for row in rows] == [12] * 4
    assert sum(row["top1"] * row["samples"] for row in rows) == pytest.approx(result["top1"] * 48)
    assert result["world_size"] == 1 and "the run logged for epoch 3" in proc.stdout


def test_eval_with_flip_averages_each_image_with_its_mirror(trained, colour_set, tmp_path):
    invoke_dimd("eval", last_checkpoint(trained), colour_set, "--tta", "flip", "--threads", "1",
                "--decode-workers", "1", "--json", tmp_path / "flip.json", check=True)
    invoke_dimd("eval", last_checkpoint(trained), colour_set, "--threads", "1",
                "--decode-workers", "1", "--json", tmp_path / "plain.json", check=True)
    flip, plain = (json.loads((tmp_path / f"{name}.json").read_text())["result"] for name in ("flip", "plain"))
    assert flip["tta"] == "flip" and flip["samples"] == plain["samples"] == 48
    assert flip["loss"] != plain["loss"]   # the mirror images' logits count too


def test_eval_refuses_a_file_that_is_no_dimd_checkpoint_in_one_line(trained, colour_set):
    proc = invoke_dimd("eval", trained / "metrics.jsonl", colour_set)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"dimd: error: {trained / 'metrics.jsonl'}: not a readable dimd "
                                                "checkpoint (not the zip archive torch.save writes: truncated, "
                                                "overwritten or another kind of file)"]


def test_eval_refuses_a_validation_set_of_other_classes_before_loading_it(trained, sample_tree, tmp_path):
    other = pack_tree_as_is(sample_tree, tmp_path / "shapes")
    proc = invoke_dimd("eval", last_checkpoint(trained), other)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "4 of its 4 classes are not classes of" in proc.stderr and str(other) in proc.stderr
