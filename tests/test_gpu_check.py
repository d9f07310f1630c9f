"""bench/gpu_check.py (`make gpu-check`) and bench/cuda_graphs.py: one command on a GPU machine, one line and exit
status 2 anywhere else; a part that fails or runs out of time is reported and the rest still runs."""

import json
import subprocess

import pytest
import torch

from conftest import BENCH, run_python

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the check would run")


@NO_CUDA
@pytest.mark.parametrize("script", ["gpu_check.py", "cuda_graphs.py", "sma_tta_gpu.py"])
def test_the_gpu_benchmarks_say_in_one_line_that_they_need_cuda_and_exit_2(script):
    proc = run_python(BENCH / script, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and "no CUDA device" in proc.stderr


def test_a_failing_part_is_reported_and_the_next_still_runs(bench, monkeypatch, tmp_path, capsys):
    check, common = bench("gpu_check"), bench("_common")

    def failing(deadline, folder):
        raise common.JobError("exit 1: dimd train ...\nRuntimeError: CUDA error: an illegal memory access")

    def slow(deadline, folder):   # one job finished, the next ran out of time
        (folder / "train_eager.json").write_text(json.dumps({"result": {"images_per_s": 987.0}}))
        raise subprocess.TimeoutExpired("dimd train", 160)

    def ranks(deadline, folder):
        return {"passed": True, "images_per_s": 1234.0, "replicas_identical": True, "graphs": ["forward", "update"]}

    monkeypatch.setattr(check, "no_cuda_line", lambda *line: None)
    monkeypatch.setattr(check, "WORK", tmp_path / "work")
    monkeypatch.setattr(check, "device_versions", lambda: {"gpu": "a stand-in", "torch": torch.__version__,
                                                           "cuda": None, "cudnn": None})
    monkeypatch.setattr(check, "PART_FUNCTIONS", {"tests": failing, "graphs": slow, "ranks": ranks, "nccl": ranks,
                                                  "feed": ranks})
    out = tmp_path / "gpu_check.json"
    assert check.main(["--json", str(out), "--parts", "tests,graphs,ranks"]) == 1
    result = json.loads(out.read_text())["result"]
    parts = result["parts"]
    assert [(name, part["status"]) for name, part in parts.items()] == \
        [("tests", "failed"), ("graphs", "timed out"), ("ranks", "passed")]
    assert parts["tests"]["error"] == "RuntimeError: CUDA error: an illegal memory access"
    assert parts["graphs"]["finished_jobs"] == {"train_eager": {"images_per_s": 987.0}}   # kept, not lost
    assert parts["ranks"]["images_per_s"] == 1234.0
    assert {t["met"] for t in result["targets"][:-1]} == {None}        # nothing measured: nothing claimed
    table = capsys.readouterr().out
    assert "| ranks | 2 ranks, 1 GPU, S-SGD b16 (forward, update) | 1,234 img/s" in table
    assert "| tests | status | failed" in table and "not measured: -" in table

    assert check.main(["--json", str(out), "--budget", "10"]) == 1     # no time: every part skipped, said so
    parts = json.loads(out.read_text())["result"]["parts"]
    assert {part["status"] for part in parts.values()} == {"skipped"}


def test_the_tests_part_runs_pytest_on_the_cuda_tests_and_reads_its_report(bench, tmp_path):
    check = bench("gpu_check")
    files = check.cuda_test_files()
    assert {f.name for f in files} >= {"test_cuda.py", "test_cuda_graphs.py"}
    import time

    figures = check.part_tests(time.monotonic() + 200, tmp_path)
    assert figures["tests"] > 10 and figures["failures"] == figures["errors"] == 0
    if not torch.cuda.is_available():
        assert figures["skipped"] == figures["tests"]
    assert figures["passed"] and figures["failed"] == []


def test_the_graphs_step_grid_runs_its_set_ups_on_the_cpu_stand_in(tmp_path):
    """The grid's job on the CPU, where the graphed strategies run on the stand-in: the script works end to end
    (its figures mean nothing here)."""
    out = tmp_path / "grid.json"
    run_python(BENCH / "cuda_graphs.py", "--job", "grid", "--model", "lenet", "--image-size", "32", "--setups",
               "ssgd:2:eager,ssgd:2:graphed,sma:2x2:eager,sma:2x2:branches", "--runs", "2", "--seconds", "0.01",
               "--json", out, check=True, timeout=240)
    result = json.loads(out.read_text())["result"]
    assert set(result["images_per_s"]) == {"S-SGD b2 eager", "S-SGD b2 graphed", "SMA 2x2 eager",
                                           "SMA 2x2 graphed (branches)"}
    assert all(len(rate["runs"]) == 2 and rate["median"] > 0 for rate in result["images_per_s"].values())
    assert set(result["ratios"]) == {"S-SGD b2 graphed / S-SGD b2 eager",
                                     "SMA 2x2 graphed (branches) / SMA 2x2 eager"}
    assert result["captures"]["SMA 2x2 graphed (branches)"]["captures"] == 3   # learners, update, sync


def test_the_nccl_parts_one_rank_runs_work_end_to_end_on_the_cpu_through_gloo(bench, packed_sample, tmp_path):
    """bench/gpu_allreduce.py's one-rank runs, which the nccl part of the check takes on a GPU, here on the CPU
    with gloo in NCCL's place: the jobs run, their JSON is read, the ratio is taken (its figures mean nothing)."""
    from types import SimpleNamespace

    gpu_allreduce = bench("gpu_allreduce")
    p = {"model": "lenet", "precision": "32-true", "image_size": 16, "batch_size": 8, "epochs": 2, "runs": 1,
         "workers": 1}
    runs = gpu_allreduce.one_rank_runs(p, SimpleNamespace(train=packed_sample, val=packed_sample), tmp_path,
                                       lambda line: None, device="cpu", backend="gloo")
    assert list(runs["train"]) == ["default (one rank skips the reduction)", "--allreduce gloo"]
    assert all(rate["median"] > 0 for rate in runs["train"].values()) and runs["over_default"]["median"] > 0
    assert runs["choices"]["--allreduce gloo"]["allreduce"] == "gloo"
    assert runs["choices"]["default (one rank skips the reduction)"]["how"] == "single rank"
