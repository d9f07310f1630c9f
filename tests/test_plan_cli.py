"""`dimd plan-batch` as a user runs it: step-time and bench-allreduce under MPI, comm, solve, and the errors."""

import json
import os
import signal
import subprocess
import time
from typing import Any, Callable

import numpy as np
import pytest
from conftest import (DIMD, invoke_dimd, launcher_is_open_mpi, mpi_command, mpi_run, run_dimd, run_mpi_dimd,
                      signal_at)
from mpi_case import case

from dimd.host import available_cores
from dimd.report import result_document, write_json
from dimd.train.plan.convergence import Run, convergence_document, synthetic_runs


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Tiny real inputs: step time of lenet at 16 px, bench-allreduce at P = 2 and 3, synthetic runs."""
    out = tmp_path_factory.mktemp("plan")
    step = out / "step.json"
    proc = run_mpi_dimd(2, "plan-batch", "step-time", "--model", "lenet", "--image-size", "16",
                        "--batch-sizes", "1,4,16", "--steps", "2", "--warmup", "1", "--quiet",
                        "--json", step, timeout=180)
    assert proc.returncode == 0, proc.stderr
    bench = []
    for ranks in (2, 3):
        path = out / f"ar-P{ranks}.json"
        proc = run_mpi_dimd(ranks, "bench-allreduce", "-a", "ring,ps,tree", "-b", "4K", "-e", "64K", "-f", "4",
                            "-n", "3", "-w", "1", "--model", "lenet", "--json", path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        bench.append(path)
    conv = out / "conv.json"
    runs = synthetic_runs(200.0, 20000.0, [8, 16, 32, 64, 128], seeds=3, rng=4)
    runs.append(Run(128, 3, None, budget=400))
    write_json(conv, convergence_document(runs, {"model": "lenet", "synthetic": True}, target="top-1 0.9"))
    return {"dir": out, "step": step, "bench": bench, "conv": conv}


@pytest.mark.mpi
def test_step_time_writes_gamma_knee_and_medians(chain):
    doc = json.loads(chain["step"].read_text())
    assert doc["command"] == "plan-batch step-time" and doc["mpi"]["world_size"] == 2
    figures = doc["result"]
    assert figures["gamma"] > 0 and 1 <= figures["m_t"] <= 16
    assert [r["batch"] for r in figures["batches"]] == [1, 4, 16]
    for row in figures["batches"]:
        assert len(row["seconds"]["runs"]) == 2 and len(row["rank_medians"]) == 2
        assert row["seconds"]["min"] <= row["seconds"]["median"] <= row["seconds"]["max"]
    if "OMP_NUM_THREADS" not in os.environ:   # cores shared by the 2 ranks, as `dimd train` sets them
        assert figures["threads"] == max(1, available_cores() // 2)
    assert figures["inputs"].startswith("synthetic")
    assert doc["parameters"]["batch_sizes"] == [1, 4, 16]


def test_step_time_on_real_batches_counts_the_loader(colour_set, tmp_path):
    """--data: the training set's batches from dimd train's loader, its decoding workers beside the step."""
    path = tmp_path / "step.json"
    proc = run_dimd("plan-batch", "step-time", "--model", "lenet", "--image-size", "16", "--batch-sizes", "2,4,8",
                    "--steps", "3", "--warmup", "1", "--threads", "1", "--data", colour_set, "--decode-workers", "1",
                    "--crop-scale", "0.5", "--quiet", "--json", path)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(path.read_text())["result"]
    assert str(colour_set) in figures["inputs"] and "1 decoding worker" in figures["inputs"]
    assert figures["step"].startswith("the wait for the loader's batch")
    assert figures["classes"] == 4   # the set's, not a default
    assert [r["batch"] for r in figures["batches"]] == [2, 4, 8] and figures["gamma"] > 0
    one_line_error(invoke_dimd("plan-batch", "step-time", "--model", "lenet", "--decode-workers", "2"),
                   "'--decode-workers': goes with --data")


@pytest.mark.mpi
def test_step_time_refuses_a_largest_batch_its_data_cannot_give_each_rank_before_any_step(colour_set):
    """48 records cannot give 2 ranks 32 images each: every rank says so at once, the job ends in order."""
    proc = run_mpi_dimd(2, "plan-batch", "step-time", "--model", "lenet", "--image-size", "16", "--batch-sizes",
                        "1,32", "--data", colour_set, "--threads", "1", "--decode-workers", "1", timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("48 records are fewer than one batch per rank (2 ranks x batch size 32)") == 1
    assert "MPI_Abort" not in proc.stderr and "Traceback" not in proc.stderr
    assert "timing lenet steps" not in proc.stderr   # refused before the first step, not at the largest batch


@pytest.mark.mpi
def test_bench_allreduce_times_the_models_gradient_size(chain):
    doc = json.loads(chain["bench"][0].read_text())
    nbytes = doc["result"]["gradient_bytes"]
    assert doc["result"]["model"] == "lenet" and nbytes > 64 << 10
    sizes = sorted({r["bytes"] for r in doc["result"]["rows"]})
    assert sizes == [4096, 16384, 65536, nbytes]


#: The chain's tiny jobs run on a shared, oversubscribed machine: how well the cost models predict
#: held-out rank counts there is a measurement (bench/), not something these plumbing tests may hang on.
ANY_FIT = ("--max-holdout-error", "1000")


@pytest.mark.mpi
def test_comm_then_solve_make_the_plan(chain):
    out = chain["dir"]
    comm = out / "comm.json"
    proc = run_dimd("plan-batch", "comm", *chain["bench"], "--max-ranks", "64", "--json", comm, check=True)
    assert "cost models" in proc.stdout and "held out: 3" in proc.stdout
    figures = json.loads(comm.read_text())["result"]
    assert figures["gradient_source"] == "recorded by bench-allreduce --model"
    assert set(figures["algorithms"]) == {"ring", "ps", "tree"}
    for fit in figures["algorithms"].values():
        assert set(fit["parameters"]) == {"a", "b", "c", "s"} and min(fit["parameters"].values()) >= 0
        assert fit["holdout"]["fit_ranks"] == [2] and fit["holdout"]["per_ranks"][0]["ranks"] == 3
        assert [p["ranks"] for p in fit["predictions"]] == [1, 2, 3, 4, 8, 16, 32, 64]

    plan = out / "plan.json"
    proc = run_dimd("plan-batch", "solve", "--step", chain["step"], "--comm", comm, "--convergence", chain["conv"],
                    *ANY_FIT, "--ranks", "1,2,3,8", "--strong-batch", "64", "--weak-per-rank", "4", "--json", plan,
                    check=True)
    assert "time to target" in proc.stdout
    doc = json.loads(plan.read_text())
    assert doc["command"] == "plan-batch solve" and doc["parameters"]["ranks"] == [1, 2, 3, 8]
    rows = doc["result"]["plan"]
    assert [r["ranks"] for r in rows] == [1, 2, 3, 8]
    for row in rows:
        assert set(row) >= {"ranks", "optimal", "strong", "weak", "algorithm"}
        assert row["optimal"]["batch"] % row["ranks"] == 0 and row["optimal"]["time_s"] > 0
        assert row["strong"]["batch"] == 64 and row["weak"]["batch"] == 4 * row["ranks"]
        assert row["optimal"]["time_s"] <= min(row["strong"]["time_s"], row["weak"]["time_s"]) * (1 + 1e-9)
    assert rows[0]["algorithm"] is None and rows[1]["algorithm"] in ("ring", "ps", "tree")


@pytest.mark.mpi
def test_solve_draws_the_plot_or_says_what_is_missing(chain, tmp_path):
    png = tmp_path / "plan.png"
    comm = chain["dir"] / "comm-plot.json"
    run_dimd("plan-batch", "comm", *chain["bench"], "--bytes", "1M", "--json", comm, check=True)
    proc = run_dimd("plan-batch", "solve", "--step", chain["step"], "--comm", comm, "--convergence",
                    chain["conv"], *ANY_FIT, "--plot", png)
    try:
        import matplotlib  # noqa: F401 (only whether it is there)
    except ImportError:
        assert proc.returncode == 1 and not png.exists()
        assert proc.stderr.strip().count("\n") == 0 and "--plot needs matplotlib" in proc.stderr
        assert "pip install --no-deps matplotlib" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def one_line_error(proc, text):
    assert proc.returncode != 0
    assert text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.mpi
def test_a_json_from_another_command_is_refused(chain):
    proc = invoke_dimd("plan-batch", "solve", "--step", chain["step"], "--comm", chain["step"],
                    "--convergence", chain["conv"])
    one_line_error(proc, "a result of `plan-batch step-time`, expected one of `plan-batch comm`")
    proc = invoke_dimd("plan-batch", "comm", chain["step"], chain["conv"], "--bytes", "1M")
    one_line_error(proc, "a result of `plan-batch step-time`, expected one of `bench-allreduce`")


@pytest.mark.mpi
def test_ranks_that_are_not_positive_integers_are_refused(chain):
    common = ["plan-batch", "solve", "--step", chain["step"], "--comm", chain["step"], "--convergence", chain["conv"]]
    one_line_error(invoke_dimd(*common, "--ranks", "0,2"), "'--ranks': must be positive integers, got 0")
    one_line_error(invoke_dimd(*common, "--ranks", "1,2.5"), "expected comma-separated int values")
    one_line_error(invoke_dimd("plan-batch", "comm", *chain["bench"], "--holdout", "1", "--bytes", "1M"),
                   "must be rank counts of at least 2")


def test_fewer_than_two_batch_sizes_is_refused():
    proc = invoke_dimd("plan-batch", "step-time", "--model", "lenet", "--batch-sizes", "8,8")
    one_line_error(proc, "needs at least 2 distinct batch sizes to fit the knee, got 8,8")
    proc = invoke_dimd("plan-batch", "step-time", "--model", "nope")
    one_line_error(proc, "'nope' is unknown; choose from lenet")


def test_a_target_no_run_reached_is_refused():
    from dimd.errors import DimdError
    from dimd.train.plan.convergence import convergence_figures

    with pytest.raises(DimdError, match="no run reached the target"):
        convergence_figures([Run(32, 0, None, budget=100), Run(64, 0, None, budget=100)])


@pytest.mark.mpi
def test_comm_says_which_size_it_lacks(chain):
    old = []
    for i, path in enumerate(chain["bench"]):   # results taken without --model
        doc = json.loads(path.read_text())
        doc["result"]["gradient_bytes"] = None
        old.append(chain["dir"] / f"ar-old-{i}.json")
        old[-1].write_text(json.dumps(doc))
    proc = invoke_dimd("plan-batch", "comm", *old)
    one_line_error(proc, "no gradient size: give --model or --bytes")
    proc = invoke_dimd("plan-batch", "comm", *chain["bench"], "--model", "lenet", "--bytes", "1M")
    one_line_error(proc, "give --model or --bytes, not both")
    proc = invoke_dimd("plan-batch", "comm", *chain["bench"], "--bytes", "0")
    one_line_error(proc, "Invalid value for '--bytes': must be positive (got 0)")


@pytest.mark.mpi
def test_solve_refuses_a_convergence_result_without_n_inf(tmp_path, chain):
    comm = chain["dir"] / "comm-check.json"
    invoke_dimd("plan-batch", "comm", *chain["bench"], "--bytes", "1M", "--json", comm, check=True)
    broken = tmp_path / "conv.json"
    write_json(broken, result_document("plan-batch convergence", {}, {"n_inf": None, "alpha": 1.0,
                                                                       "batches": [{"batch": 8}]}))
    proc = invoke_dimd("plan-batch", "solve", "--step", chain["step"], "--comm", comm, "--convergence", broken,
                    *ANY_FIT)
    one_line_error(proc, "`result.n_inf` must be a finite number >= 0, got null")


def test_require_matplotlib_is_one_line(monkeypatch):
    import importlib.util

    from dimd.errors import DimdError
    from dimd.train.plan import plot

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DimdError) as info:
        plot.require_matplotlib()
    assert "\n" not in str(info.value) and "--plot needs matplotlib" in str(info.value)


def test_help_names_the_steps():
    text = " ".join(invoke_dimd("plan-batch", "--help", check=True).stdout.split())
    for step in ("step-time", "comm", "solve"):
        assert step in text
    text = " ".join(invoke_dimd("plan-batch", "convergence", "--help", check=True).stdout.split())
    assert "each group asks rank 0 for its next run as it finishes one, largest M first" in text   # not dealt out


# ---------------------------------------------------------------------------- convergence
def convergence_args(data, *extra):
    return ["plan-batch", "convergence", data, "--val", data, "--model", "lenet", "--image-size", "16",
            "--crop-scale", "1", "--threads", "1", "--decode-workers", "1", "-q", *map(str, extra)]


def score_by_law(n_inf: float, alpha: float, samples: int = 1) -> Callable[[Any], Any]:
    """A ``Trainer.evaluate`` whose top-1 is 1 once the run has taken N_inf + alpha/M steps, 0 before."""
    from dimd.train.evaluate import EvalResult

    def evaluate(trainer: Any) -> EvalResult:
        reached = trainer.state.step >= n_inf + alpha / trainer.global_batch
        return EvalResult(loss=0.0, top1=1.0 if reached else 0.0, top5=1.0, samples=samples, seconds=0.0)

    return evaluate


@case
def dimd_scored_by_known_law(n_inf: str, alpha: str, *args: str) -> None:
    """``dimd ARGS`` with validation top-1 replaced by a known law: 1 once a run has taken N_inf + alpha/M steps.

    The real engine trains; only the score is set, so ``plan-batch convergence``'s
    updates-to-target come out exactly::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py dimd_scored_by_known_law 3 32 plan-batch convergence ...
    """
    from dimd.cli import main
    from dimd.train.engine import Trainer

    Trainer.evaluate = score_by_law(float(n_inf), float(alpha))  # type: ignore[method-assign]
    main(list(args), prog_name="dimd")


@pytest.fixture(scope="module")
def conv(colour_set, tmp_path_factory):
    """2 ranks, a run each at a time, the real engine, validation "top-1" by a known law: 1 from step
    N = 3 + 32/M on. Evaluated every 16 images (and at epoch ends): M = 4 every 4 steps, so first at step 12
    (N = 11); M = 8 every 2, at 8 (N = 7); M = 16 every step, at 5 (N = 5); M = 48 needs 4 steps and has
    1 an epoch, 2 in all: never."""
    path = tmp_path_factory.mktemp("conv") / "conv.json"
    proc = mpi_run(dimd_scored_by_known_law, 2, "3", "32",
                   *convergence_args(colour_set, "--target-top1", "0.5", "--batch-sizes", "4,8,16,48",
                                     "--seeds", "2", "--max-epochs", "2", "--eval-every-images", "16",
                                     "--json", path), timeout=240)
    return proc, path


@pytest.mark.mpi
def test_convergence_under_mpi_hands_out_the_runs_and_fits_the_inverse_law(conv):
    proc, path = conv
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    assert doc["command"] == "plan-batch convergence" and doc["mpi"]["world_size"] == 2
    figures = doc["result"]
    assert figures["ranks_per_run"] == 1 and figures["groups"] == 2 and figures["eval_every_images"] == 16
    assert len(figures["group_seconds"]) == 2
    runs = {(r["batch"], r["seed"]): r for r in figures["runs"]}
    assert sorted(runs) == [(m, s) for m in (4, 8, 16, 48) for s in (0, 1)]
    assert {r["group"] for r in runs.values()} == {0, 1}       # both ranks trained
    assert figures["optimizer"] == "sgd" and {r["optimizer"] for r in runs.values()} == {"sgd"}   # what trained
    for (batch, _), run in runs.items():
        assert run["updates"] == {4: 12, 8: 8, 16: 5, 48: None}[batch]
        assert run["lr"] == pytest.approx(0.1 * batch / 256) and run["ranks"] == 1   # dimd train's lr, scaled
        assert run["budget"] == 2 * (48 // batch)
        if run["reached"]:
            assert run["images_to_target"] == run["updates"] * batch and run["train_seconds_to_target"] > 0
    rows = {row["batch"]: row for row in figures["batches"]}
    assert [rows[m]["median_updates"] for m in (4, 8, 16)] == [12, 8, 5] and not rows[48]["in_fit"]
    # the medians (12, 8, 5) against 1/M: least squares of the relative residuals, (N_inf + alpha x) / y - 1
    x, y = np.array([1 / 4, 1 / 8, 1 / 16]), np.array([12, 8, 5])
    (n_inf, alpha), *_ = np.linalg.lstsq(np.column_stack([1 / y, x / y]), np.ones(3), rcond=None)
    assert figures["alpha"] == pytest.approx(alpha) and figures["n_inf"] == pytest.approx(n_inf)
    assert 0.9 < figures["r2"] <= 1


@pytest.mark.mpi
def test_a_run_that_never_reaches_the_target_is_reported(conv):
    proc, path = conv
    figures = json.loads(path.read_text())["result"]
    row = {r["batch"]: r for r in figures["batches"]}[48]
    assert row["unreached"] == 2 and row["median_updates"] is None
    assert row["unreached_runs"] == [{"seed": 0, "budget": 2, "reason": "budget"},
                                     {"seed": 1, "budget": 2, "reason": "budget"}]
    assert figures["unreached_runs"] == 2
    assert "not reached: M=48 seed 0: NOT reached (budget; budget 2 updates)" in proc.stdout
    assert "N_update(M) = N_inf + alpha/M for sgd" in proc.stdout


@pytest.mark.mpi
def test_the_chain_step_time_comm_convergence_solve(chain, conv):
    out = chain["dir"]
    comm = out / "comm-conv.json"
    run_dimd("plan-batch", "comm", *chain["bench"], "--max-ranks", "8", "--json", comm, check=True)
    plan = out / "plan-conv.json"
    proc = run_dimd("plan-batch", "solve", "--step", chain["step"], "--comm", comm, "--convergence", conv[1],
                    *ANY_FIT, "--ranks", "1,2,4", "--max-batch", "48", "--json", plan, check=True)
    assert "time to target" in proc.stdout
    doc = json.loads(plan.read_text())["result"]
    conv_fit = json.loads(conv[1].read_text())["result"]
    assert doc["model"]["n_inf"] == conv_fit["n_inf"] and doc["model"]["alpha"] == conv_fit["alpha"]
    assert doc["measured"]["global_batches"] == [4, 16]   # the batches in the fit
    assert [row["ranks"] for row in doc["plan"]] == [1, 2, 4]


def test_convergence_on_one_rank_without_mpirun(colour_set, tmp_path):
    """Real scores, so only what holds for any model: the updates are the steps at the first evaluation
    that reached the target, evaluations come every 24 images and at epoch ends."""
    path = tmp_path / "conv1.json"
    proc = run_dimd(*convergence_args(colour_set, "--target-top1", "0.3", "--batch-sizes", "4,16",
                                      "--seeds", "1", "--eval-every-images", "24", "--max-epochs", "2",
                                      "--lr", "2", "--json", path))
    assert proc.returncode == 0 or "reached the target" in proc.stderr, proc.stderr
    figures = json.loads(path.read_text())["result"]
    assert figures["groups"] == 1 and {r["batch"] for r in figures["runs"]} == {4, 16}
    for run in figures["runs"]:
        steps = [e[0] for e in run["evaluations"]]
        per_epoch = 48 // run["batch"]
        due = sorted({-(-24 * k // run["batch"]) for k in range(1, 5)} | {per_epoch, 2 * per_epoch})
        assert steps == due[: len(steps)]
        hits = [e[0] for e in run["evaluations"] if e[1] >= 0.3]
        assert run["updates"] == (hits[0] if hits else None) and run["reached"] == bool(hits)
        assert steps[-1] == (run["updates"] if hits else 2 * per_epoch)   # it stops at the target


def test_convergence_trains_its_runs_with_the_optimizer_it_is_given_and_names_it(colour_set, tmp_path):
    path = tmp_path / "conv_lars.json"
    proc = run_dimd(*convergence_args(colour_set, "--target-top1", "0.3", "--batch-sizes", "4,16", "--seeds", "1",
                                      "--max-epochs", "1", "--lr", "2", "--optimizer", "lars", "--lars-trust",
                                      "0.02", "--json", path))
    assert proc.returncode == 0 or "reached the target" in proc.stderr, proc.stderr
    figures = json.loads(path.read_text())["result"]
    assert {run["optimizer"] for run in figures["runs"]} == {"lars"}


def test_convergence_refuses_bad_inputs_in_one_line(colour_set, tmp_path):
    one_line_error(invoke_dimd(*convergence_args(colour_set, "--target-top1", "0.5", "--batch-sizes", "8,8")),
                   "needs at least 2 distinct global batch sizes to fit N_inf and alpha, got 8,8")
    one_line_error(invoke_dimd(*convergence_args(colour_set, "--target-top1", "0.5", "--batch-sizes", "8,0")),
                   "'--batch-sizes': must be positive, got 0")
    one_line_error(invoke_dimd(*convergence_args(colour_set, "--target-top1", "1.5", "--batch-sizes", "8,16")),
                   "'--target-top1': must be in (0.0, 1.0]")
    one_line_error(invoke_dimd(*convergence_args(colour_set, "--target-top1", "0.5", "--batch-sizes", "8,16",
                                              "--ranks-per-run", "0")), "'--ranks-per-run': must be at least 1")
    one_line_error(invoke_dimd(*convergence_args(colour_set, "--target-top1", "0.5", "--batch-sizes", "8,12",
                                              "--ranks-per-run", "8")),
                   "'--batch-sizes': must be multiples of --ranks-per-run (8)")
    one_line_error(invoke_dimd(*convergence_args(colour_set, "--target-top1", "0.5", "--batch-sizes", "8,16",
                                              "--ranks-per-run", "2")),
                   "--ranks-per-run 2 does not divide the job's 1 rank(s)")
    one_line_error(invoke_dimd(*convergence_args(colour_set, "--target-top1", "0.5", "--batch-sizes", "8,64")),
                   "--batch-sizes: 64 is more than the 48 records")
    one_line_error(invoke_dimd(*convergence_args(tmp_path / "nothing", "--target-top1", "0.5",
                                                 "--batch-sizes", "8,16")), "index file not found")


@pytest.mark.mpi
def test_convergence_refuses_a_validation_set_of_other_classes_before_any_run(colour_set, packed_sample):
    """Two groups of one rank: both would find it as their first run starts; the job refuses it first, in order."""
    args = convergence_args(colour_set, "--target-top1", "0.5", "--batch-sizes", "8,16")
    args[args.index("--val") + 1] = str(packed_sample)
    proc = run_mpi_dimd(2, *args, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count(f"{packed_sample}: 4 of its 4 classes are not classes of {colour_set}") == 1
    assert "MPI_Abort" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.mpi
def test_a_stop_signal_during_a_run_ends_the_sweep_as_terminated(colour_set):
    """SIGTERM to mpiexec mid-run (a scheduler's time limit) ends it as between runs: one line, 128 + 15."""
    if launcher_is_open_mpi():
        pytest.skip("Open MPI's mpirun kills the ranks 250 ms after a SIGTERM (docs/batch-jobs.md)")
    args = convergence_args(colour_set, "--target-top1", "0.99", "--batch-sizes", "4,8", "--lr", "1e-6",
                            "--max-epochs", "1000")
    args.remove("-q")   # its header: the runs start
    env = dict(os.environ)
    job = subprocess.Popen(mpi_command(2, [*DIMD, *args], env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env)
    out, err = signal_at(job, "runs to validation top-1", lambda j: (time.sleep(3), j.send_signal(signal.SIGTERM)))
    assert job.returncode == 128 + signal.SIGTERM, out + err
    assert err.count("terminated (SIGTERM)") == 1 and "stopped by" not in err, err


def test_a_target_no_run_reaches_is_one_line_and_the_runs_are_kept(colour_set, tmp_path):
    path = tmp_path / "never.json"
    proc = run_dimd(*convergence_args(colour_set, "--target-top1", "1.0", "--batch-sizes", "24,48",
                                      "--seeds", "1", "--max-epochs", "1", "--lr", "0.01", "--json", path))
    one_line_error(proc, "no run reached the target 1.0 (2 runs at batches 24, 48): lower the target or raise "
                         f"the budget (every run is in {path})")
    assert proc.stderr.strip().count("\n") == 0
    figures = json.loads(path.read_text())["result"]
    assert figures["n_inf"] is None and figures["unreached_runs"] == 2 and len(figures["runs"]) == 2
    proc = invoke_dimd("plan-batch", "solve", "--step", path, "--comm", path, "--convergence", path)
    one_line_error(proc, "a result of `plan-batch convergence`, expected one of `plan-batch step-time`")
