"""Every JSON the planner reads is checked against its schema before any arithmetic, and sizes are bounded.

Each bad input is one line naming the file and the field, never a traceback,
a hang, a multi-GiB allocation or a "-" in the table.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import invoke_dimd


def write_result(path, command: str, result, **envelope) -> None:
    """A result file as another tool (or an older dimd) may write it: NaN stays NaN, as json.dumps writes it."""
    path.write_text(json.dumps({"command": command, "parameters": {}, **envelope, "result": result}))

STEP = {"overhead": 0.001, "gamma": 0.01, "m_t": 8.0, "batches": [{"batch": 1}, {"batch": 64}]}
COMM = {"algorithms": {"ring": {"parameters": {"a": 1e-5, "b": 1e-10, "c": 0.0, "s": 0.0}, "holdout": None}},
        "gradient_bytes": 4096, "ranks_measured": [2, 3]}
CONVERGENCE = {"n_inf": 1000.0, "alpha": 1e5, "batches": [{"batch": 16, "in_fit": True}, {"batch": 256}]}


def solve(tmp_path, step=STEP, comm=COMM, convergence=CONVERGENCE, *options: str):
    for name, command, result in (("step", "plan-batch step-time", step), ("comm", "plan-batch comm", comm),
                                  ("conv", "plan-batch convergence", convergence)):
        write_result(tmp_path / f"{name}.json", command, result)
    return invoke_dimd("plan-batch", "solve", "--step", tmp_path / "step.json", "--comm", tmp_path / "comm.json",
                       "--convergence", tmp_path / "conv.json", "--ranks", "1,2,4", *options)


def one_line(proc) -> str:
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_valid_inputs_plan(tmp_path):
    proc = solve(tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_a_step_result_that_is_null_is_one_line(tmp_path):
    assert "step.json: `result` must be an object with 'overhead', 'gamma', 'm_t', 'batches', got null" in \
        one_line(solve(tmp_path, step=None))


@pytest.mark.parametrize("value, shown", [(math.nan, "nan"), (-1e-5, "-1e-05")])
def test_a_fitted_cost_that_is_nan_or_negative_is_one_line(tmp_path, value, shown):
    comm = {**COMM, "algorithms": {"ring": {"parameters": {**COMM["algorithms"]["ring"]["parameters"], "a": value}}}}
    assert f"comm.json: `result.algorithms.ring.parameters.a` must be a finite number >= 0, got {shown}" in \
        one_line(solve(tmp_path, comm=comm))


def test_algorithms_written_as_a_list_is_one_line(tmp_path):
    comm = {**COMM, "algorithms": [COMM["algorithms"]["ring"]]}
    assert "comm.json: `result.algorithms` must be an object of named entries" in one_line(solve(tmp_path, comm=comm))


def test_a_rank_count_beyond_the_bound_is_refused_before_any_allocation(tmp_path):
    proc = solve(tmp_path, STEP, COMM, CONVERGENCE, "--ranks", "1,1000000000", "--algorithms", "ring")
    assert proc.returncode == 2 and "1,000,000,000 ranks" in proc.stderr and "1,048,576" in proc.stderr


def bench_file(tmp_path, name, ranks, row):
    rows = [{"algorithm": "ring", "bytes": 65536, "time_us": 100.0 * ranks, "wrong": None}, row]
    write_result(tmp_path / name, "bench-allreduce", {"world_size": ranks, "rows": rows},
                 mpi={"cores": 2, "local_ranks": ranks})
    return tmp_path / name


@pytest.mark.parametrize("row, message", [
    ({"algorithm": "ring", "bytes": 1 << 20, "time_us": math.nan, "wrong": None},
     "`result.rows[1].time_us` must be a finite number >= 0, got nan"),
    ({"algorithm": "ring", "bytes": "1K", "time_us": 12.0, "wrong": None},
     "`result.rows[1].bytes` must be an integer >= 0, got '1K'"),
])
def test_a_bench_row_the_fit_cannot_use_is_one_line(tmp_path, row, message):
    good = bench_file(tmp_path, "p2.json", 2, {"algorithm": "ring", "bytes": 1 << 20, "time_us": 900.0})
    bad = bench_file(tmp_path, "p3.json", 3, row)
    proc = invoke_dimd("plan-batch", "comm", good, bad, "--bytes", "1M")
    assert f"p3.json: {message}" in one_line(proc)


def test_a_huge_max_ranks_is_refused_not_run(tmp_path):
    good = bench_file(tmp_path, "p2.json", 2, {"algorithm": "ring", "bytes": 1 << 20, "time_us": 900.0})
    proc = invoke_dimd("plan-batch", "comm", good, "--bytes", "1M", "--max-ranks", str(10**15))
    assert proc.returncode == 2 and "the planner predicts for at most 1,048,576" in proc.stderr


def test_an_image_size_beyond_memory_is_one_line_before_any_allocation():
    from conftest import run_dimd

    proc = run_dimd("plan-batch", "step-time", "--model", "lenet", "--image-size", "200000",
                        "--batch-sizes", "1,2", "--steps", "1", "--warmup", "0", "--device", "cpu", timeout=120)
    assert proc.returncode == 1
    assert "`image_size`" not in proc.stderr and "--image-size 200000 at 2 images per rank needs" in proc.stderr
    assert "for the input alone" in proc.stderr and "Traceback" not in proc.stderr


def test_solve_names_the_optimizer_and_says_in_one_line_which_batches_lie_beyond_the_critical_batch(tmp_path):
    """CONVERGENCE's alpha / N_inf = 100 images: a strong batch of 512 and the weak 64 per rank on 2 and 4
    ranks lie beyond it."""
    import json

    proc = solve(tmp_path, STEP, COMM, {**CONVERGENCE, "optimizer": "lars"}, "--strong-batch", "512",
                 "--weak-per-rank", "64", "--json", tmp_path / "plan.json")
    assert proc.returncode == 0, proc.stderr
    assert "N_update = 1000 + 1e+05/M with lars (alpha/N_inf = 100)" in proc.stdout
    beyond = [line for line in proc.stdout.splitlines() if "critical batch" in line]
    assert beyond == ["# beyond the lars fit's critical batch alpha/N_inf = 100: the strong M 512 (P = 1-4), "
                      "the weak M at P = 2-4; N_update there extrapolates the fit: sweep such batches"]
    figures = json.loads((tmp_path / "plan.json").read_text())["result"]
    assert figures["optimizer"] == "lars" and figures["critical_batch"] == 100.0
    assert figures["beyond_critical_batch"] == {"optimal": [], "strong": [1, 2, 4], "weak": [2, 4]}
    older = solve(tmp_path, STEP, COMM, CONVERGENCE, "--strong-batch", "64")   # no optimizer named: SGD's
    assert "with sgd (alpha/N_inf = 100)" in older.stdout and "critical batch" not in older.stdout.split("\n", 1)[1]
