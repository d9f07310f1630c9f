"""dimd train --noise-scale: McCandlish et al.'s B_simple, estimated from the gradient allreduce for free."""

import json

import pytest
from conftest import invoke_dimd, mpi_run, run_mpi_dimd


@pytest.mark.mpi
def test_the_engines_estimate_equals_the_estimator_fed_offline_with_the_same_gradients(colour_set):
    proc = mpi_run("noise_scale_matches_offline_estimator", 2, colour_set, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok 8 steps" in proc.stdout     # 48 images / (2 ranks x 6) = 4 steps an epoch, 2 epochs


def train_args(data, *extra):
    return ["train", data, "--val", data, "--model", "lenet", "--image-size", "16", "--epochs", "2",
            "--batch-size", "6", "--threads", "1", "--decode-workers", "1", *map(str, extra)]


@pytest.mark.mpi
def test_noise_scale_goes_into_every_metrics_line_and_the_json_history(colour_set, tmp_path):
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "t.json"
    proc = run_mpi_dimd(2, *train_args(colour_set, "--noise-scale", "--metrics", metrics, "--json", summary))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    history = json.loads(summary.read_text())["result"]["history"]
    assert len(lines) == len(history) == 2
    for line, epoch in zip(lines, history):
        assert line["noise_steps"] == epoch["noise_steps"] == 4 * line["epoch"]
        assert "noise_scale" in line and line["noise_scale"] == epoch["noise_scale"]
        assert line["noise_trace"] is not None and line["noise_gradient_sqnorm"] is not None
    assert "B_simple" in proc.stdout


def test_noise_scale_is_refused_on_one_rank_and_with_sma_in_one_line(colour_set):
    proc = invoke_dimd(*train_args(colour_set, "--noise-scale"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dimd: error: --noise-scale needs at least 2 ranks: it compares each rank's gradient with their "
        "average (run under mpirun -n 2 or more)"]
    proc = invoke_dimd(*train_args(colour_set, "--noise-scale", "--sync", "sma"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "'--noise-scale': is defined for S-SGD only" in proc.stderr and proc.stderr.strip().count("\n") == 0
