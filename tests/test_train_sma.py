"""SMA on real ranks: distribution does not change the algorithm; `dimd train --sync sma` end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import invoke_dimd, mpi_run, run_dimd, run_mpi_dimd
from mpi_case import case, reduction, say, world


def small_bn_model(classes: int = 5) -> Any:
    """A convolution, batch norm and a linear layer: quick, and it has running statistics."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes))


@case
def sma_distribution(learners_per_rank: str, compute: str = "loop", algorithm: str = "ring") -> None:
    """P ranks x K learners against one process with P*K learners fed the same batches.

    Rank 0 prints how far the distributed z (and, relatively, its averaged batch-norm
    statistics) is from the single-process one, how far three synchronisations moved z, and
    whether z is bit-identical on every rank::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py sma_distribution 2
        -> z diff 1.2e-08 buffers diff 3e-09 moved 0.03 identical True
    """
    import torch

    from dimd.train.sma import SMA
    from dimd.train.steps import StepPlace

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    k = int(learners_per_rank)
    total, b = size * k, 3

    def sma(learners: int, world_size: int, reduce, device_reduce: Any = None) -> SMA:
        torch.manual_seed(0)
        return SMA(small_bn_model(), reduce, world_size, learners=learners, alpha=None, momentum=0.9,
                   central_momentum=None, weight_decay=1e-3, compute=compute, device_reduce=device_reduce)

    g = torch.Generator().manual_seed(42)
    steps = [[(torch.randint(0, 255, (b, 3, 16, 16), dtype=torch.uint8, generator=g),
               torch.randint(0, 5, (b,), generator=g)) for _ in range(total)] for _ in range(3)]
    mine = sma(k, size, *reduction(algorithm, comm))   # gloo: Delta summed on the device path
    start = mine.z.clone()
    for batches in steps:
        result = mine.step(batches[rank * k:(rank + 1) * k], StepPlace(lr=0.05))
        assert result.synced and result.samples == total * b, result
    mine.eval_model()
    identical = mine.identical(comm)
    if rank == 0:
        single = sma(total, 1, lambda a: None)
        for batches in steps:
            single.step(batches, StepPlace(lr=0.05))
        single.eval_model()
        z_diff = float((mine.z - single.z).abs().max())
        buffers_diff = float(((mine.z_floats - single.z_floats).abs() / single.z_floats.abs().clamp(min=1)).max())
        moved = float((mine.z - start).abs().max())
        say(f"z diff {z_diff:.3g} buffers diff {buffers_diff:.3g} moved {moved:.3g} identical {identical}")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, per_rank, compute, algorithm", [(2, 2, "threads", "ring"), (3, 1, "loop", "gloo")])
def test_p_ranks_of_k_learners_equal_one_process_of_p_times_k(ranks, per_rank, compute, algorithm):
    """2 ranks x 2 learners against 1 x 4, and 3 x 1 against 1 x 3, fed the same batches; Delta summed over
    MPI (ring), or in place through torch.distributed (gloo, the path NCCL takes on GPUs)."""
    proc = mpi_run(sma_distribution, ranks, per_rank, compute, algorithm, check=True)
    line = next(text for text in proc.stdout.splitlines() if text.startswith("z diff"))
    _, _, z_diff, _, _, buffers_diff, _, moved, _, identical = line.split()
    assert float(z_diff) < 1e-6, line           # the same z within float tolerance
    assert float(buffers_diff) < 1e-5, line     # and the same averaged batch-norm statistics
    assert float(moved) > 1e-3, line            # after synchronisations that really moved it
    assert identical == "True", line            # bit-identical on every rank


@case
def sma_losses_around_a_reshuffle(data: str) -> None:
    """SMA on ``data`` (a packed set in class order) twice at equal seeds: reshuffled at every epoch,
    and with every reshuffle after the first placement keeping the records where they are.

    Rank 0 prints each run's per-synchronisation training loss and each rank prints the
    classes its learners drew in epoch 1, one JSON line each::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py sma_losses_around_a_reshuffle colours
        -> {"run": "reshuffled", "losses": [...], "steps_per_epoch": 6}
           {"rank": 0, "epoch_1_classes": [7, 5, 6, 6]}
    """
    import numpy as np

    from dimd.shuffle import DistributedStore
    from dimd.train.config import SMAConfig, TrainConfig
    from dimd.train.engine import Trainer

    comm = world()
    config = TrainConfig(train=data, val=data, model="resnet20", image_size=16, epochs=2, batch_size=4, momentum=0.0,
                         lr=0.05, lr_scaling=False, schedule="constant", decode_workers=1, threads=1,
                         allreduce="ring", sync="sma", sma=SMAConfig(learners=1))
    shuffle = DistributedStore.shuffle

    def keep_after_the_first_step(store: Any, seed: int, round: int) -> Any:
        if trainer.state.step == 0:
            return shuffle(store, seed, round)
        store.round = round                     # the reshuffle replaced by the identity
        return None

    def recording(trainer: Any) -> tuple[list, list]:
        """Each step's loss, and the label counts of the first epoch's steps on this rank."""
        step, losses, labels = trainer.strategy.step, [], []

        def recorded(batches: Any, place: Any, **options: Any) -> Any:
            result = step(batches, place, **options)
            losses.append(result.loss_sum / result.samples)
            if len(labels) < trainer.steps_per_epoch:
                labels.append(np.bincount(np.concatenate([b[1].numpy() for b in batches]), minlength=4))
            return result

        trainer.strategy.step = recorded
        return losses, labels

    for run in ("reshuffled", "kept"):
        if run == "kept":
            DistributedStore.shuffle = keep_after_the_first_step  # type: ignore[method-assign]
        trainer = Trainer(config, comm)
        losses, labels = recording(trainer)
        trainer.run()
        if comm.Get_rank() == 0:
            say(json.dumps({"run": run, "losses": losses, "steps_per_epoch": trainer.steps_per_epoch}))
        if run == "reshuffled":
            say(json.dumps({"rank": comm.Get_rank(), "epoch_1_classes": np.sum(labels, axis=0).tolist()}))
    DistributedStore.shuffle = shuffle  # type: ignore[method-assign]


@pytest.mark.mpi
def test_a_reshuffle_does_not_knock_smas_learners_back(colour_set):
    """The colour set is packed in class order, so a rank's share in load order holds two of its
    four classes. Every rank's learners must draw from every class from the first step, and the
    epoch after a reshuffle must train about as well as the same epoch with the records kept in
    place (in load order the learners fit two classes, and the reshuffle raised the loss 10x)."""
    proc = mpi_run(sma_losses_around_a_reshuffle, 2, str(colour_set), timeout=240, check=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    classes = [line["epoch_1_classes"] for line in lines if "rank" in line]
    assert len(classes) == 2 and all(sum(1 for n in seen if n) >= 3 for seen in classes), classes
    runs = {line["run"]: line for line in lines if "run" in line}
    steps = runs["kept"]["steps_per_epoch"]
    reshuffled, kept = (sum(runs[r]["losses"][steps:]) / steps for r in ("reshuffled", "kept"))
    assert runs["reshuffled"]["losses"][:steps] == runs["kept"]["losses"][:steps]   # equal seeds
    assert reshuffled < 3 * kept, (runs["reshuffled"]["losses"], runs["kept"]["losses"])


# -- `dimd train --sync sma` end to end ------------------------------------------------------

EPOCHS = 4
BATCHES = 6                  # 48 records // (2 ranks x batch 4): batches per rank per epoch


def sma_args(data: Path, out: Path, *extra: str, model: str = "resnet20") -> list:
    return ["train", data, "--val", data, "--model", model, "--image-size", "32", "--epochs", str(EPOCHS),
            "--batch-size", "4", "--lr", "0.02", "--no-lr-scaling", "--schedule", "step",
            "--milestones", "2", "--decode-workers", "1", "--threads", "1", "--allreduce", "ring",
            "--shuffle-every", "5", "--sync", "sma", "--learners", "2",
            "--checkpoint-dir", out / "checkpoints", "--json", out / "train.json", *extra]


def checkpoints(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("checkpoint-*.pt"))


@pytest.fixture(scope="module")
def sma_run(packed_sample, tmp_path_factory):
    """2 ranks x 2 learners x batch 4, four epochs of 3 steps, a checkpoint every 2 steps, all kept."""
    out = tmp_path_factory.mktemp("sma")
    proc = run_mpi_dimd(2, *sma_args(packed_sample, out, "--checkpoint-every", "2", "--keep-checkpoints", "0",
                                     "--metrics", out / "metrics.jsonl"), timeout=240, check=True)
    return out, proc


@pytest.mark.mpi
def test_sma_trains_with_an_identical_central_model_and_reports_its_figures(sma_run):
    out, proc = sma_run
    result = json.loads((out / "train.json").read_text())["result"]
    assert result["sync"] == "sma" and result["replicas_identical"] is True
    assert result["learners_per_rank"] == [2] * EPOCHS and result["alpha"] == pytest.approx(1 / 4)
    assert result["central_momentum"] == 0.0 and result["compute"] == "loop"
    assert result["synchronisations"] == EPOCHS * BATCHES // 2 and result["restarts"] == 1
    history = result["history"]
    assert [e["epoch"] for e in history] == [1, 2, 3, 4]
    assert all(e["images"] == 2 * BATCHES * 4 and e["synchronisations"] == 3 for e in history)
    assert set(history[0]["time_split"]) == {"data", "compute", "allreduce", "optimizer", "sync"}
    assert history[0]["time_split"]["sync"] > 0 and history[0]["sync"] == "sma"
    assert [e["lr"] for e in history] == pytest.approx([0.02, 0.02, 0.002, 0.002])
    assert proc.stdout.count("restart at step 6 (epoch 2)") == 1     # at the milestone, once
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["learners_per_rank"] for line in lines] == [2] * EPOCHS and lines[0]["alpha"] == 0.25
    assert "SMA: 2 ranks x 2 learner(s) x batch 4" in proc.stdout and "learners/rank" in proc.stdout


@pytest.mark.mpi
def test_an_sma_checkpoint_holds_z_and_every_learner(sma_run):
    out, _ = sma_run
    steps = [int(p.name.split("-s")[1].split(".")[0]) for p in checkpoints(out)]
    assert steps == [2, 3, 4, 6, 8, 9, 10, 12]
    state = torch.load(checkpoints(out)[-1], weights_only=True)
    from dimd.train.checkpoint import VERSION

    assert state["sync"] == "sma" and state["version"] == VERSION
    assert state["strategy"]["learners"] == 2 and state["strategy"]["delta_prev"].abs().sum() > 0
    learners = state["ranks"][1]["strategy"]["learners"]
    assert learners["weights"].shape[0] == 2 and learners["momentum"].shape == learners["weights"].shape
    assert learners["buffers"].shape[0] == 2
    # the checkpointed model is z with batch-norm statistics of its own, not the learners' averaged
    rows = torch.cat([r["strategy"]["learners"]["buffers"] for r in state["ranks"]])
    stem = state["model"]["stem.1.running_mean"]
    assert torch.isfinite(stem).all() and not torch.allclose(rows.mean(dim=0)[: stem.numel()], stem)


@pytest.mark.mpi
def test_sma_resume_mid_epoch_continues_exactly(sma_run, packed_sample, tmp_path):
    """From step 4 (epoch 2, before the reshuffle at step 5 and the restart at step 6): the same z."""
    out, _ = sma_run
    start = out / "checkpoints" / "checkpoint-e0001-s00000004.pt"
    run_mpi_dimd(2, *sma_args(packed_sample, tmp_path, "--resume-from", start), timeout=240, check=True)
    straight = torch.load(checkpoints(out)[-1], weights_only=True)
    resumed = torch.load(checkpoints(tmp_path)[-1], weights_only=True)
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    for mine, theirs in zip(straight["ranks"], resumed["ranks"]):
        assert torch.equal(mine["strategy"]["learners"]["weights"], theirs["strategy"]["learners"]["weights"])
    history = json.loads((tmp_path / "train.json").read_text())["result"]["history"]
    assert [e["epoch"] for e in history] == [1, 2, 3, 4]


@pytest.mark.mpi
def test_sma_resume_on_another_rank_count_at_an_epoch_boundary_recreates_the_learners(sma_run, packed_sample,
                                                                                       tmp_path):
    out, _ = sma_run
    boundary = out / "checkpoints" / "checkpoint-e0002-s00000006.pt"
    proc = run_dimd(*sma_args(packed_sample, tmp_path, "--resume-from", boundary, "--learners", "3"),
                    timeout=240, check=True)
    assert "differs from this run's" in proc.stdout and "continuing from the end of epoch 2" in proc.stdout
    assert "re-created as 3 per rank from the central model z" in proc.stdout
    result = json.loads((tmp_path / "train.json").read_text())["result"]
    assert [e["learners_per_rank"] for e in result["history"]] == [2, 2, 3, 3]
    assert [e["lr"] for e in result["history"]] == pytest.approx([0.02, 0.02, 0.002, 0.002])


def with_options(args: list, **changes) -> list:
    """``args`` with ``--flag value`` pairs set (a value of None removes the pair)."""
    args = list(args)
    for name, value in changes.items():
        flag = "--" + name.replace("_", "-")
        if flag in args:
            i = args.index(flag)
            if value is None:
                del args[i:i + 2]
            else:
                args[i + 1] = value
        elif value is not None:
            args += [flag, value]
    return args


def ssgd_args(data: Path, out: Path, *extra: str) -> list:
    return with_options(sma_args(data, out, *extra), sync="ssgd", learners=None)


@pytest.mark.parametrize("sma, changes, field, problem", [
    ({"learners": 0}, {}, "learners", "must be at least 1"),
    ({"learners": "many"}, {}, "learners", "must be a number of learners per rank or auto"),
    ({"alpha": 0.0}, {}, "alpha", "must be in (0.0, 1.0]"),
    ({"alpha": 1.5}, {}, "alpha", "must be in (0.0, 1.0]"),
    ({"sync_every": 0}, {}, "sync_every", "must be at least 1"),
    ({"sma_momentum": 1.0}, {}, "sma_momentum", "must be in [0.0, 1.0)"),
    ({"autotune_threshold": -0.1}, {}, "autotune_threshold", "must be at least 0"),
    ({}, {"ssgd": {"nesterov": True}}, "nesterov", "is a setting of S-SGD: SMA's learners use Polyak momentum"),
    ({}, {"ssgd": {"overlap": False}}, "overlap", "is a setting of S-SGD"),
    ({}, {"sync": "ssgd"}, "learners", "is a setting of model averaging: add `sync` sma"),
    ({"learners": None, "sync_every": 2}, {"sync": "ssgd"}, "sync_every", "is a setting of model averaging"),
    ({}, {"sync": "average"}, "sync", "must be one of ssgd, sma"),
])
def test_the_config_refuses_bad_sma_settings_naming_the_field(sma, changes, field, problem):
    from dimd.errors import ConfigError
    from dimd.train.config import SMAConfig, SSGDConfig, TrainConfig

    if "ssgd" in changes:
        changes = {**changes, "ssgd": SSGDConfig(**changes["ssgd"])}
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**{"train": "t", "val": "v", "sync": "sma", "sma": SMAConfig(**{"learners": 2, **sma}), **changes})
    assert caught.value.field == field and problem in caught.value.problem


@pytest.mark.mpi
def test_bad_sma_options_are_one_clear_line_and_write_nothing(packed_sample, tmp_path):
    for extra, message in [(["--alpha", "1.5"], "Invalid value for '--alpha': must be in (0.0, 1.0]"),
                           (["--learners", "many"], "expected a number of learners per rank or 'auto'")]:
        proc = invoke_dimd(*sma_args(packed_sample, tmp_path, *extra))
        assert proc.returncode == 2, (extra, proc.stderr)
        assert message in proc.stderr and proc.stderr.lower().count("error") == 1, (extra, proc.stderr)
    # on every rank of an MPI job: one line, exit 2, the other flag named
    proc = run_mpi_dimd(2, *with_options(sma_args(packed_sample, tmp_path), sync="ssgd"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("'--learners': is a setting of model averaging: add --sync sma") == 1, proc.stderr
    assert not (tmp_path / "train.json").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.mpi
def test_checkpoints_of_the_other_sync_or_mid_epoch_on_another_layout_are_refused(sma_run, packed_sample,
                                                                                  tmp_path):
    out, _ = sma_run
    ssgd, fresh = tmp_path / "ssgd", tmp_path / "fresh"
    ssgd.mkdir()
    fresh.mkdir()   # --json's folder must exist (checked at start-up); nothing may be written in it
    run_dimd(*ssgd_args(packed_sample, ssgd, "--epochs", "1", "--model", "lenet"), timeout=120, check=True)
    cases = [   # refused before anything loads, so one process (this one) shows each
        (ssgd_args(packed_sample, fresh, "--resume-from", checkpoints(out)[-1]),
         "a checkpoint of a --sync sma run, this run is --sync ssgd; resume it with --sync sma"),
        (sma_args(packed_sample, fresh, "--resume-from", checkpoints(ssgd)[-1], "--model", "lenet"),
         "a checkpoint of a --sync ssgd run, this run is --sync sma; resume it with --sync ssgd"),
        (sma_args(packed_sample, fresh, "--resume-from", out / "checkpoints" / "checkpoint-e0001-s00000004.pt"),
         "written mid-epoch (epoch 2, step 4) with 2 ranks, 2 learners per rank, groups 1, batch 4, shuffle "
         "every 5; this run has 1 ranks, 2 learners per rank, groups 1, batch 4, shuffle every 5: resume it "
         "with that layout, or resume from "),
    ]
    for args, message in cases:
        proc = invoke_dimd(*args)
        assert proc.returncode == 1, (args, proc.stderr)
        assert message in proc.stderr and proc.stderr.count("dimd: error:") == 1, proc.stderr
        assert list(fresh.iterdir()) == []
    assert "checkpoint-e0001-s00000003.pt (an epoch boundary) on any layout" in proc.stderr


@pytest.mark.mpi
def test_a_diverged_run_exits_non_zero_and_keeps_the_last_good_checkpoint(sma_run, packed_sample, tmp_path):
    out, _ = sma_run
    shutil.copytree(out / "checkpoints", tmp_path / "checkpoints")
    before = {p.name: p.read_bytes() for p in checkpoints(tmp_path)}
    start = tmp_path / "checkpoints" / "checkpoint-e0002-s00000006.pt"
    sma = run_mpi_dimd(2, *sma_args(packed_sample, tmp_path, "--resume-from", start, "--lr", "1e12",
                                    "--keep-checkpoints", "1"), timeout=120)
    ssgd = run_dimd(*ssgd_args(packed_sample, tmp_path, "--lr", "1e12", "--keep-checkpoints", "1",
                               "--checkpoint-dir", tmp_path / "ssgd"), timeout=120)   # one rank: S-SGD's check
    for proc in (sma, ssgd):
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.count("dimd: error:") == 1 and "training diverged at step" in proc.stderr, proc.stderr
        assert "lower --lr" in proc.stderr
    assert {p.name: p.read_bytes() for p in checkpoints(tmp_path)} == before   # nothing rotated out
    assert "the last good checkpoint is" in proc.stderr and not (tmp_path / "train.json").exists()


@case
def dimd_with_validation_loss_nan_from_epoch(epoch: str, *args: str) -> None:
    """``dimd ARGS`` whose validation loss is NaN from the evaluation ending epoch ``epoch`` (1-based) on:
    the real engine trains and scores; only the loss sum of the scores is replaced::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py dimd_with_validation_loss_nan_from_epoch 2 train ...
    """
    from dimd.cli import main
    from dimd.train import engine

    real_evaluate, real_counts, evaluations = engine.Trainer.evaluate, engine.local_counts, []

    def evaluate(trainer: Any) -> Any:
        evaluations.append(1)
        return real_evaluate(trainer)

    def counts(*positional: Any, **options: Any) -> Any:   # the scores: a row of counts per model
        result = real_counts(*positional, **options)
        if len(evaluations) >= int(epoch):
            result[..., 0] = float("nan")   # each row's loss sum
        return result

    engine.Trainer.evaluate = evaluate  # type: ignore[method-assign]
    engine.local_counts = counts  # type: ignore[assignment]
    main(list(args), prog_name="dimd")


@pytest.mark.mpi
@pytest.mark.parametrize("sync", ["ssgd", "sma"])
def test_a_validation_loss_that_is_not_finite_ends_the_run_as_a_diverged_one(sync, packed_sample, tmp_path):
    args = [str(a) for a in (sma_args if sync == "sma" else ssgd_args)(packed_sample, tmp_path)]
    proc = mpi_run(dimd_with_validation_loss_nan_from_epoch, 2, "2", *args, timeout=240)
    assert proc.returncode != 0, proc.stdout
    assert proc.stderr.count("dimd: error:") == 1, proc.stderr
    assert "training diverged at step" in proc.stderr and "(validation loss nan)" in proc.stderr, proc.stderr
    assert "the last good checkpoint is" in proc.stderr and "checkpoint-e0001" in proc.stderr, proc.stderr
    assert [p.name[:16] for p in checkpoints(tmp_path)] == ["checkpoint-e0001"]   # nothing after it
    assert not (tmp_path / "train.json").exists()
