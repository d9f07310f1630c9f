"""`dimd plan-batch` as a user runs it: step-time and bench-allreduce under MPI, comm, solve, and the errors."""

import json
import os

import pytest
from conftest import run_dimd, run_mpi_dimd

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
    proc = run_dimd("plan-batch", "solve", "--step", chain["step"], "--comm", chain["step"],
                    "--convergence", chain["conv"])
    one_line_error(proc, "a result of `plan-batch step-time`, expected one of `plan-batch comm`")
    proc = run_dimd("plan-batch", "comm", chain["step"], chain["conv"], "--bytes", "1M")
    one_line_error(proc, "a result of `plan-batch step-time`, expected one of `bench-allreduce`")


@pytest.mark.mpi
def test_ranks_that_are_not_positive_integers_are_refused(chain):
    common = ["plan-batch", "solve", "--step", chain["step"], "--comm", chain["step"], "--convergence", chain["conv"]]
    one_line_error(run_dimd(*common, "--ranks", "0,2"), "'--ranks': must be positive integers, got 0")
    one_line_error(run_dimd(*common, "--ranks", "1,2.5"), "expected comma-separated int values")
    one_line_error(run_dimd("plan-batch", "comm", *chain["bench"], "--holdout", "1", "--bytes", "1M"),
                   "must be rank counts of at least 2")


def test_fewer_than_two_batch_sizes_is_refused():
    proc = run_dimd("plan-batch", "step-time", "--model", "lenet", "--batch-sizes", "8,8")
    one_line_error(proc, "needs at least 2 distinct batch sizes to fit the knee, got 8,8")
    proc = run_dimd("plan-batch", "step-time", "--model", "nope")
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
    proc = run_dimd("plan-batch", "comm", *old)
    one_line_error(proc, "no gradient size: give --model or --bytes")
    proc = run_dimd("plan-batch", "comm", *chain["bench"], "--model", "lenet", "--bytes", "1M")
    one_line_error(proc, "give --model or --bytes, not both")


@pytest.mark.mpi
def test_solve_refuses_a_convergence_result_without_n_inf(tmp_path, chain):
    comm = chain["dir"] / "comm-check.json"
    run_dimd("plan-batch", "comm", *chain["bench"], "--bytes", "1M", "--json", comm, check=True)
    broken = tmp_path / "conv.json"
    write_json(broken, result_document("plan-batch convergence", {}, {"n_inf": None, "alpha": 1.0,
                                                                       "batches": [{"batch": 8}]}))
    proc = run_dimd("plan-batch", "solve", "--step", chain["step"], "--comm", comm, "--convergence", broken,
                    *ANY_FIT)
    one_line_error(proc, "no number 'n_inf' in its result (got None)")


def test_require_matplotlib_is_one_line(monkeypatch):
    import importlib.util

    from dimd.errors import DimdError
    from dimd.train.plan import plot

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DimdError) as info:
        plot.require_matplotlib()
    assert "\n" not in str(info.value) and "--plot needs matplotlib" in str(info.value)


def test_help_names_the_steps():
    text = " ".join(run_dimd("plan-batch", "--help", check=True).stdout.split())
    for step in ("step-time", "comm", "solve"):
        assert step in text
