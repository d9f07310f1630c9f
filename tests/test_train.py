"""`mpirun dimd train` end to end on real ranks: replicas, loss, checkpoints, resume, signals, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import DIMD, invoke_dimd, mpi_command, pack_tree_as_is, run_dimd, run_mpi_dimd, signal_at
from hostile import mpi_error

EPOCHS = 4
STEPS_PER_EPOCH = 3          # 48 records // (2 ranks x 8)


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", data, "--val", data, "--model", "resnet20", "--image-size", "32",
            "--epochs", str(EPOCHS), "--batch-size", "8", "--lr", "0.01", "--no-lr-scaling",
            "--schedule", "constant", "--decode-workers", "1", "--threads", "1", "--allreduce", "ring",
            "--shuffle-every", "2",     # mid-epoch reshuffles across the ranks (the default is every epoch)
            "--checkpoint-dir", out / "checkpoints", "--json", out / "train.json", *extra]


@pytest.fixture(scope="module")
def straight_run(packed_sample, tmp_path_factory):
    """Four epochs on 2 ranks, a checkpoint every 2 steps (mid-epoch ones too), all kept."""
    out = tmp_path_factory.mktemp("straight")
    proc = run_mpi_dimd(2, *train_args(packed_sample, out, "--checkpoint-every", "2",
                                       "--keep-checkpoints", "0", "--metrics", out / "metrics.jsonl"),
                        timeout=180, check=True)
    return out, proc


def final_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    newest = sorted(checkpoint_dir.glob("checkpoint-*.pt"))[-1]
    return torch.load(newest, weights_only=True)["model"]


@pytest.mark.mpi
def test_two_ranks_train_stay_identical_and_loss_falls(straight_run):
    out, proc = straight_run
    doc = json.loads((out / "train.json").read_text())
    result = doc["result"]
    assert doc["command"] == "train" and result["world_size"] == 2
    assert result["replicas_identical"] is True
    assert result["steps_per_epoch"] == STEPS_PER_EPOCH and result["epochs_run"] == EPOCHS
    history = result["history"]
    assert [e["epoch"] for e in history] == [1, 2, 3, 4]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert all(e["images"] == STEPS_PER_EPOCH * 16 and e["images_per_s"] > 0 for e in history)
    assert set(history[0]["time_split"]) == {"data", "compute", "allreduce", "optimizer", "sync"}
    assert 0 <= result["val_top1"] <= result["val_top5"] <= 1
    assert doc["mpi"]["world_size"] == 2 and doc["parameters"]["model"] == "resnet20"
    assert (result["threads"], result["decode_workers"]) == (1, 1)   # what the options came to
    assert doc["commit"] and doc["date"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3, 4]
    assert proc.stdout.count("epoch ") >= EPOCHS and "done: val top1" in proc.stdout


@pytest.mark.mpi
def test_without_noise_scale_the_metrics_lines_carry_no_noise_figures(straight_run):
    out, proc = straight_run
    for line in (out / "metrics.jsonl").read_text().splitlines():
        assert not any(key.startswith("noise") for key in json.loads(line))
    assert "B_simple" not in proc.stdout


@pytest.mark.mpi
def test_checkpoints_are_complete_and_named_by_epoch_and_step(straight_run):
    out, _ = straight_run
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    steps = [int(n.split("-s")[1].split(".")[0]) for n in names]
    assert steps == [2, 3, 4, 6, 8, 9, 10, 12]          # every 2 steps and every epoch end
    assert not [n for n in os.listdir(out / "checkpoints") if n.startswith(".")]  # no temporaries left
    state = torch.load(out / "checkpoints" / names[-1], weights_only=True)
    assert state["format"] == "dimd-checkpoint" and state["epoch"] == EPOCHS and state["step"] == 12
    assert len(state["ranks"]) == 2 and "loader" in state["ranks"][1]


@pytest.fixture(scope="module")
def resumed_run(straight_run, packed_sample, tmp_path_factory):
    """The straight run continued from step 4 (epoch 2, step 1 of 3, just before a reshuffle) with --allreduce
    gloo (torch.distributed's group, started from MPI, reducing the flat buffer in place: the path NCCL takes on
    GPUs), its metrics file as a crashed run left it, a checkpoint every 2 steps, all kept."""
    ring, _ = straight_run
    out = tmp_path_factory.mktemp("resumed")
    shutil.copy(ring / "metrics.jsonl", out / "metrics.jsonl")   # epochs 1-4
    proc = run_mpi_dimd(2, *train_args(packed_sample, out, "--allreduce", "gloo", "--checkpoint-every", "2",
                                       "--keep-checkpoints", "0", "--metrics", out / "metrics.jsonl", "--resume-from",
                                       ring / "checkpoints" / "checkpoint-e0001-s00000004.pt"),
                        timeout=180, check=True)
    return out, proc


@pytest.mark.mpi
def test_resume_mid_epoch_continues_exactly(straight_run, resumed_run):
    """Resumed from step 4, mid-epoch: the same final weights."""
    (out, _), (resumed, _) = straight_run, resumed_run
    straight, weights = final_weights(out / "checkpoints"), final_weights(resumed / "checkpoints")
    assert straight.keys() == weights.keys()
    for name in straight:
        assert torch.allclose(straight[name].double(), weights[name].double(), atol=1e-6), name
    history = json.loads((resumed / "train.json").read_text())["result"]["history"]
    assert [e["epoch"] for e in history] == [1, 2, 3, 4]   # the history travels in the checkpoint
    lines = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1, 2, 3, 4]   # epochs 2-4 ran again: their old lines went
    assert len({line["run_id"] for line in lines}) == 1


@pytest.mark.mpi
def test_gloo_resumes_the_ring_runs_checkpoint_and_trains_its_very_weights(straight_run, resumed_run):
    """Sums of two ranks are exact whichever way they go, so every checkpoint gloo's run writes holds the ring
    run's very weights."""
    (ring, _), (gloo, proc) = straight_run, resumed_run
    result = json.loads((gloo / "train.json").read_text())["result"]
    assert result["allreduce"] == "gloo" and result["allreduce_choice"]["how"] == "requested"
    assert result["replicas_identical"] and "allreduce gloo" in proc.stdout
    names = sorted(p.name for p in (gloo / "checkpoints").iterdir())
    assert [int(n.split("-s")[1].split(".")[0]) for n in names] == [6, 8, 9, 10, 12], names   # written by gloo's run
    for name in names:
        a, b = (torch.load(run / "checkpoints" / name, weights_only=True)["model"] for run in (ring, gloo))
        assert all(torch.equal(a[key], b[key]) for key in a), name


@pytest.fixture(scope="module")
def one_rank_run(straight_run, packed_sample, tmp_path_factory):
    """The straight run's epoch-2 checkpoint continued on 1 rank, quiet, the rate stepped down at epoch 3."""
    out = tmp_path_factory.mktemp("one-rank")
    boundary = straight_run[0] / "checkpoints" / "checkpoint-e0002-s00000006.pt"
    args = train_args(packed_sample, out, "--resume-from", boundary, "--schedule", "step", "--milestones", "3",
                      "--quiet")
    return out, run_dimd(*args, timeout=180, check=True)


@pytest.mark.mpi
def test_quiet_training_prints_its_epochs_but_no_progress(straight_run, one_rank_run):
    (_, loud), (_, quiet) = straight_run, one_rank_run
    assert "train: " in loud.stderr and "train: " not in quiet.stderr
    assert "epoch 4/4" in quiet.stdout and "done: val top1" in quiet.stdout


@pytest.mark.mpi
def test_resume_on_another_rank_count_at_an_epoch_boundary(one_rank_run):
    """Two epochs on 2 ranks, the rest on 1: the schedule continues by epochs, not by raw steps."""
    out, proc = one_rank_run
    assert "differs from this run's" in proc.stdout and "continuing from the end of epoch 2" in proc.stdout
    result = json.loads((out / "train.json").read_text())["result"]
    assert result["world_size"] == 1 and result["steps_per_epoch"] == 2 * STEPS_PER_EPOCH
    history = result["history"]
    assert [e["epoch"] for e in history] == [1, 2, 3, 4]
    assert [e["lr"] for e in history] == pytest.approx([0.01, 0.01, 0.01, 0.001])
    assert [e["images"] for e in history] == [48, 48, 48, 48]
    steps = [int(p.name.split("-s")[1].split(".")[0]) for p in sorted((out / "checkpoints").iterdir())]
    assert steps == [12, 18]            # 6 + 6 steps of one rank per epoch


@pytest.mark.mpi
def test_sigusr1_finishes_the_step_checkpoints_and_exits_cleanly(packed_sample, tmp_path):
    args = train_args(packed_sample, tmp_path)
    args[args.index("--epochs") + 1] = "1000"
    args[args.index("--shuffle-every") + 1] = "epoch"
    args += ["--groups", "2"]      # two shuffle groups of one rank, each holding the whole set
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(mpi_command(2, [*DIMD, *args], env), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env)
    # once training starts, warn like SLURM does (the requeued job's resume: tests/test_bin_jobs.py)
    output, _ = signal_at(job, " parameters, ", lambda j: j.send_signal(signal.SIGUSR1))
    assert job.returncode == 0, output
    assert "stopped by SIGUSR1" in output and "--resume" in output
    result = json.loads((tmp_path / "train.json").read_text())["result"]
    assert result["stopped_by"] == "SIGUSR1"
    state = torch.load(result["checkpoint"], weights_only=True)
    assert state["step"] >= 1 and len(state["ranks"]) == 2


@pytest.fixture(scope="module")
def foreign_val(sample_tree, tmp_path_factory):
    """A packed set whose classes are not the training set's."""
    root = tmp_path_factory.mktemp("foreign") / "tree"
    for name in ("purple-blob", "grey-wave"):
        (root / name).mkdir(parents=True)
        for i, source in enumerate(sorted(sample_tree.rglob("*.JPEG"))[:3]):
            (root / name / f"{i}.JPEG").write_bytes(source.read_bytes())
    return pack_tree_as_is(root, root.parent / "packed")


@pytest.mark.mpi
def test_bad_inputs_give_one_clear_error_and_write_nothing(packed_sample, foreign_val, straight_run, tmp_path):
    unknown = invoke_dimd(*train_args(packed_sample, tmp_path), "--model", "alexnet")
    assert unknown.returncode == 2  # a usage error: the choice comes from the model registry
    assert "Invalid value for '--model': 'alexnet' is not one of 'lenet', 'resnet20'" in unknown.stderr
    cases = [
        (["--val", foreign_val], "2 of its 2 classes are not classes of"),
        (["--val", tmp_path / "missing"], "missing.idx.h5: index file not found"),
        (["--batch-size", "64"], "fewer than one batch per rank"),
        (["--model", "lenet", "--resume-from", final_checkpoint(straight_run[0])],
         "checkpoint of model 'resnet20', not 'lenet'"),
    ]
    for extra, message in cases:
        proc = invoke_dimd(*train_args(packed_sample, tmp_path), *extra)
        assert proc.returncode == 1, (extra, proc.stderr)
        assert message in proc.stderr and proc.stderr.count("dimd: error:") == 1, (extra, proc.stderr)
        assert not (tmp_path / "train.json").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.mpi
def test_an_error_on_every_rank_ends_the_mpi_job_once_before_the_load(packed_sample, tmp_path):
    proc = run_mpi_dimd(2, *train_args(packed_sample, tmp_path), "--batch-size", "64", timeout=120)
    assert mpi_error(proc) == (f"{packed_sample}.dimd: 48 records are fewer than one batch per rank "
                               f"(2 ranks x batch size 64); use a smaller batch")
    assert proc.stderr.count("fewer than one batch per rank") == 1, proc.stderr
    assert "loaded" not in proc.stdout and "MPI_Abort" not in proc.stderr
    assert not (tmp_path / "train.json").exists()


@pytest.mark.mpi
def test_a_missing_checkpoint_to_resume_from_is_named_before_the_load(packed_sample, tmp_path):
    missing = tmp_path / "nowhere" / "checkpoint-e0001-s00000003.pt"
    proc = run_mpi_dimd(2, *train_args(packed_sample, tmp_path, "--resume-from", missing), timeout=120)
    assert mpi_error(proc) == f"{missing}: checkpoint not found"
    assert "loaded" not in proc.stdout


def test_list_models_shows_counts_and_gradient_bytes():
    proc = invoke_dimd("train", "--list-models", check=True)
    for name in ("lenet", "resnet20", "resnet56", "resnet18", "resnet50", "vgg16", "nin", "googlenet-bn"):
        assert f"\n{name} " in "\n" + proc.stdout
    assert "25,557,032" in proc.stdout      # resnet50 for 1000 classes


def final_checkpoint(out: Path) -> Path:
    return sorted((out / "checkpoints").glob("checkpoint-*.pt"))[-1]
