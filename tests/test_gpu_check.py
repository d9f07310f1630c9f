"""bench/gpu_check.py (`make gpu-check`) and bench/cuda_graphs.py: one command on a GPU machine, one line and exit
status 2 anywhere else; its plan fits its budget; and the whole check runs here, on the CPU, with stand-ins for
the jobs that would start GPU processes, so that a bug in the harness never spends a GPU's minutes."""

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

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


def test_the_plan_prints_each_parts_jobs_and_fits_the_budget_without_a_gpu(bench):
    proc = run_python(BENCH / "gpu_check.py", "--plan", timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    steps = [line.split(":")[0] for line in lines if re.match(r"^\w+: \d+ s$", line)]
    assert steps == ["prepare", "tests", "graphs", "ranks", "nccl", "feed"]
    total, budget = map(int, re.fullmatch(r"total (\d+) s of a (\d+) s budget", lines[-1]).groups())
    assert total <= budget == 420
    assert sum(int(line.split(": ")[1].split()[0]) for line in lines if line.split(":")[0] in steps) >= total

    check = bench("gpu_check")
    plan = check.make_plan(list(check.PARTS), check.BUDGET_S, check.COSTS, check.SETS)
    assert plan.total <= plan.budget and plan.mark("feed") == plan.total
    assert all(job.seconds > 0 for jobs in plan.steps.values() for job in jobs)
    assert list(check.make_plan(["tests"], 420, check.COSTS, check.SETS).steps) == ["tests"]   # no set: no prepare
    assert check.make_plan(["nccl", "ranks"], 420, check.COSTS, check.SETS).sets == ("32 px",)


# ----------------------------------------------------------------------------- the whole check, device stubbed
#: A sample set small enough to generate and pack here in seconds (both of the check's sets, built once).
TINY = {"classes": 2, "per_class": 3, "val_per_class": 1, "short_side": 36, "large_share": 0.0}


class DeviceStandIn:
    """In place of every job that would start a GPU process (``_common.json_job``, which every ``dimd_job`` and
    ``python_job`` goes through, and the tests part's ``pytest -m cuda``): it writes the JSON the job would write,
    with plausible figures (images/s grow with the batch and six-fold with graphs), after a short pause. A job
    whose command line holds a word of ``hang`` runs until its time limit; one of ``fail``, exits 1."""

    def __init__(self, job_error: type[Exception]) -> None:
        self.job_error, self.hang, self.fail, self.launched = job_error, set(), set(), []

    def _start(self, words: list[str], timeout: float) -> None:
        self.launched.append(words)
        if self.hang & set(words):
            time.sleep(timeout)
            raise subprocess.TimeoutExpired(words, timeout)
        if self.fail & set(words):
            raise self.job_error(f"exit 1: {' '.join(words)}\nRuntimeError: CUDA error: an illegal memory access")
        time.sleep(0.01)

    def json_job(self, argv, json_path: Path, *, env=None, timeout: float = 1800) -> None:
        from dimd.report import result_document, write_json

        words = [str(word) for word in argv]
        self._start(words, timeout)
        if "--job" in words:
            command = f"bench/{Path(words[words.index('--job') - 1]).name}"
            result = getattr(self, words[words.index("--job") + 1])(words)
        else:
            command = words[next(i for i, w in enumerate(words) if w.endswith("/dimd")) + 1]
            result = getattr(self, command.replace("-", "_"))(words)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(json_path, result_document(command, {"argv": words}, result))

    def pytest(self, command, *, env=None, timeout: float = 1800, log: Path) -> str:
        """``pytest -m cuda -v``: three tests pass (each printed as it ends), then its JUnit report."""
        words = [str(word) for word in command]
        tests = [f"tests/test_cuda.py::test_{i}" for i in range(3)]
        log.write_text("".join(f"{name} PASSED\n" for name in tests))
        self._start(words, timeout)
        report = Path(next(w for w in words if w.startswith("--junitxml=")).split("=", 1)[1])
        report.write_text(f'<testsuites><testsuite tests="{len(tests)}" failures="0" errors="0" skipped="0">'
                          + "".join(f'<testcase classname="test_cuda" name="{n.split("::")[1]}"/>' for n in tests)
                          + "</testsuite></testsuites>")
        return log.read_text()

    # -- what each kind of job reports
    @staticmethod
    def value(words: list[str], flag: str, default=None):
        return words[words.index(flag) + 1] if flag in words else default

    def rate(self, images: int, graphed: bool) -> float:
        return 100.0 * images * (6 if graphed else 1)

    def train(self, words: list[str]) -> dict:
        batch, learners = int(self.value(words, "--batch-size")), int(self.value(words, "--learners", 1))
        ranks, epochs = int(self.value(words, "-n", 1)), int(self.value(words, "--epochs"))
        graphed = "--no-cuda-graphs" not in words and batch < 128
        graphs = (["forward", "update"] if ranks > 1 else ["step"]) if learners == 1 else \
            [f"learner {j}" for j in range(learners)] + ["update", "sync"]
        rate = self.rate(batch * learners, graphed) * (0.99 if "nccl" in words else 1.0)
        named = self.value(words, "--allreduce")
        return {"history": [{"epoch": e, "images_per_s": rate} for e in range(epochs)], "images_per_s": rate,
                "seconds": 2.0 * epochs, "epochs_run": epochs, "replicas_identical": True, "val_top1": 0.5,
                "allreduce": named or ("ring" if ranks > 1 else "none"), "time_split": {"compute": 0.9},
                "allreduce_choice": {"how": "requested" if named else "single rank"},
                "cuda_graphs": {"on": graphed, "rule": "on: a stand-in" if graphed else "off: a stand-in",
                                "captures": [{"graph": g} for g in graphs] if graphed else [],
                                "capture_seconds": 0.02 if graphed else 0.0}}

    def bench_allreduce(self, words: list[str]) -> dict:
        low, high, factor = (int(self.value(words, flag)) for flag in ("-b", "-e", "-f"))
        sizes = [low * factor ** i for i in range(8) if low * factor ** i <= high] + [102_228_128]
        algorithms = ["nccl", "d2h+h2d", *self.value(words, "-a").split(",")]
        return {"rows": [{"bytes": b, "algorithm": a, "time_us": b / 1e4, "busbw_gbs": 0.0, "wrong": 0}
                         for b in sizes for a in algorithms], "wrong_total": 0, "gradient_bytes": sizes[-1]}

    def grid(self, words: list[str]) -> dict:
        import cuda_graphs

        setups = [cuda_graphs.Setup.parse(text) for text in self.value(words, "--setups").split(",")]
        runs = int(self.value(words, "--runs"))
        rates = {s.name: [self.rate(s.images, s.graphed) * (1 + 0.01 * run) for run in range(runs)] for s in setups}
        captures = {s.name: {"capture_seconds": 0.01, "pool_bytes": 1 << 20, "captures": [{}] * s.graphs}
                    for s in setups if s.graphed}
        return {"device": "cuda:0", **cuda_graphs.grid_figures(setups, rates, captures)}

    def ceiling(self, words: list[str]) -> dict:
        return {"images_per_s": [self.rate(128, False)] * int(self.value(words, "--epochs"))}

    def dataloader(self, words: list[str]) -> dict:
        return {"images_per_s": [0.8 * self.rate(128, False)] * int(self.value(words, "--epochs"))}


class Harness:
    """bench/gpu_check.py as on a GPU machine, its device jobs done by a :class:`DeviceStandIn` (``device``), in
    a work folder of its own, on the tiny sample set, with a cost model priced for stand-ins that take hundredths
    of a second (and for this shared machine's real ``dimd sample-data`` and ``pack``)."""

    def __init__(self, bench, monkeypatch, folder: Path) -> None:
        self.check, common, gpu_feed = bench("gpu_check"), bench("_common"), bench("gpu_feed")
        self.device, self.folder = DeviceStandIn(common.JobError), folder
        monkeypatch.setattr(common, "json_job", self.device.json_job)
        monkeypatch.setattr(self.check, "run", self.device.pytest)
        monkeypatch.setattr(self.check, "no_cuda_line", lambda *line: None)
        monkeypatch.setattr(self.check, "device_versions", lambda: {"gpu": "a stand-in", "gpus": 1, "cuda": None,
                                                                    "torch": torch.__version__, "cudnn": None})
        monkeypatch.setattr(self.check, "gpu_count", lambda: 1)   # one GPU, as the machines lent here have
        monkeypatch.setattr(gpu_feed, "has_torchvision", lambda: True)   # its DataLoader jobs run, as planned
        monkeypatch.setattr(self.check, "WORK", folder / "work")
        monkeypatch.setitem(self.check.GRAPHS, "seconds", 0.01)
        self.costs = bench("gpu_costs").Costs(process_s=0.5, mpi_s=0.1, train_start_s=0.2, setup_s=0.02,
                                              capture_s=0.02, dataloader_start_s=0.1, allreduce_row_s=0.01,
                                              cuda_test_s=0.02, cli_s=4.0)
        self.sets = {name: self.check.SetSpec(**TINY) for name in self.check.SETS}

    def run(self, *argv: str) -> tuple[int, dict]:
        out = self.folder / "gpu_check.json"
        status = self.check.main(["--json", str(out), *argv], costs=self.costs, sets=self.sets)
        return status, json.loads(out.read_text())["result"]


@pytest.fixture
def harness(bench, monkeypatch, tmp_path) -> Harness:
    return Harness(bench, monkeypatch, tmp_path)


def test_the_whole_check_runs_on_the_cpu_with_its_device_jobs_stood_in_for(harness, capsys):
    """Planning, the prepare step (real dimd sample-data and pack, on the tiny set), the schedule, every part's
    own code, the JSON, the targets and the table, for real; only the GPU processes are stand-ins."""
    status, result = harness.run()
    parts = result["parts"]
    assert status == 0 and {name: part["status"] for name, part in parts.items()} == {
        **dict.fromkeys(["prepare", "tests", "graphs", "nccl", "feed"], "passed"), "ranks": "not measured"}
    assert parts["ranks"]["why"] == "2 ranks need 2 GPUs, and this machine has 1: dimd refuses two ranks on one GPU"
    assert parts["prepare"]["records"] == {"32 px": 6, "224 px": 6}
    plan = result["plan"]
    assert plan["total"] <= plan["budget"] == 420
    planned = sum(len(plan["steps"][part]["jobs"]) for part in harness.check.PARTS if part != "ranks")
    assert len(harness.device.launched) == planned          # one launch for each job the plan priced, none unpriced
    # (the ranks part's job is priced, as a machine with 2 GPUs runs it, and not launched on one GPU)

    assert parts["graphs"]["step_grid"]["resnet20"]["ratios"]["S-SGD b16 graphed / S-SGD b16 eager"]["median"] == \
        pytest.approx(6.0)
    assert parts["nccl"]["choices"]["--allreduce nccl"]["allreduce"] == "nccl"
    assert set(parts["feed"]["setups"]) == {"resnet50 32-true", "resnet18 bf16-mixed"}
    targets = {t["target"]: t for t in result["targets"]}
    measured = [t for t in targets.values() if t["status"] == "measured"]
    assert len(measured) == 7 and all(t["met"] for t in measured)
    assert all(t["status"] == "not measured" and t["met"] is None for t in targets.values() if t not in measured)
    nccl = targets["NCCL across ranks: the gradients' reduction between the graphs on NCCL's group, replicas "
                   "identical"]
    assert nccl["status"] == "not measured" and "two or more" in nccl["why"]

    table = capsys.readouterr().out
    assert "| target | NCCL across ranks: the gradients' reduction between the graphs on NCCL's group, replicas " \
           "identical (on two or more GPUs) | not measured: one GPU: NCCL refuses two ranks on one GPU" in table
    assert "| target | resnet20 32 px b16: S-SGD graphed / eager (step grid) (>= 5.0) | measured 6: met |" in table
    assert "| ranks | status | not measured in 0 s of" in table and "dimd refuses two ranks on one GPU |" in table


def test_a_part_cut_off_or_failing_keeps_its_finished_jobs_and_the_next_still_runs(harness, capsys):
    """``pytest -m cuda`` hangs (the tests it finished are kept), the graphs part's third dimd train hangs (its
    step grids and first runs are kept, and the targets they hold are measured), bench-allreduce fails: each is
    cut at its limit or reported, and every next part runs."""
    harness.check.SetSpec(**TINY).build(harness.check.WORK, time.monotonic() + 120)   # prepare finds it built,
    harness.costs = dataclasses.replace(harness.costs, cli_s=0.1)                     # and priced so, soon done
    harness.device.hang, harness.device.fail = {"pytest", "--learners"}, {"bench-allreduce"}
    status, result = harness.run()
    parts = result["parts"]
    assert status == 1
    assert {name: part["status"] for name, part in parts.items()} == {
        "prepare": "passed", "tests": "failed", "graphs": "timed out", "ranks": "not measured",
        "nccl": "failed",
        "feed": "passed"}
    assert parts["tests"]["error"] == "timed out" and len(parts["tests"]["finished"]) == 3
    assert set(parts["graphs"]["finished_jobs"]) == {"grid_resnet20", "grid_resnet18", "train_S-SGD_b16_eager",
                                                     "train_S-SGD_b16_graphed"}
    assert parts["nccl"]["error"] == "RuntimeError: CUDA error: an illegal memory access"
    targets = {t["target"]: t for t in result["targets"]}
    assert targets["resnet20 32 px b16: S-SGD graphed / eager (step grid)"]["status"] == "measured"   # kept
    dimd_train = targets["resnet20 32 px b16: S-SGD graphed / eager (dimd train)"]
    assert (dimd_train["status"], dimd_train["met"], dimd_train["why"]) == ("not measured", None,
                                                                           "the graphs part timed out")
    assert targets["one rank, resnet20 32 px b16: --allreduce nccl / default (dimd train)"]["why"] == \
        "the nccl part failed"
    assert "| tests | finished before the cut | 3 tests: 3 passed |" in capsys.readouterr().out

    status, result = harness.run("--budget", "0")   # no time: every step skipped, and each says why
    assert status == 1 and {part["status"] for part in result["parts"].values()} == {"skipped"}
    assert result["parts"]["graphs"]["error"].startswith("no sample set")


def test_the_tests_part_runs_pytest_on_the_cuda_tests_and_reads_its_report(bench, tmp_path):
    check = bench("gpu_check")
    files = check.cuda_test_files()
    assert {f.name for f in files} >= {"test_cuda.py", "test_cuda_graphs.py"}
    figures = check.part_tests(check.Turn(time.monotonic() + 200, tmp_path, {}))
    assert figures["tests"] == sum(check.count_tests(f) for f in files)   # the plan counts what pytest collects
    assert figures["failures"] == figures["errors"] == 0
    if not torch.cuda.is_available():
        assert figures["skipped"] == figures["tests"]
    assert figures["passed"] and figures["failed"] == []


def test_the_graphs_step_grid_runs_its_set_ups_on_the_cpu_stand_in(bench, tmp_path):
    """The grid's job on the CPU, where the graphed strategies run on the stand-in: the script works end to end
    (its figures mean nothing here)."""
    cuda_graphs, out = bench("cuda_graphs"), tmp_path / "grid.json"
    run_python(BENCH / "cuda_graphs.py", "--job", "grid", "--model", "lenet", "--image-size", "32", "--setups",
               "ssgd:2:eager,ssgd:2:graphed,sma:2x2:eager,sma:2x2:branches", "--runs", "2", "--seconds", "0.01",
               "--json", out, check=True, timeout=240)
    result = json.loads(out.read_text())["result"]
    assert set(result["images_per_s"]) == {"S-SGD b2 eager", "S-SGD b2 graphed", "SMA 2x2 eager",
                                           "SMA 2x2 graphed (branches)"}
    assert all(len(rate["runs"]) == 2 and rate["median"] > 0 for rate in result["images_per_s"].values())
    assert set(result["ratios"]) == {"S-SGD b2 graphed / S-SGD b2 eager",
                                     "SMA 2x2 graphed (branches) / SMA 2x2 eager"}
    assert result["captures"]["SMA 2x2 graphed (branches)"]["captures"] == 3     # learners, update, sync
    assert [cuda_graphs.Setup.parse(text).graphs for text in ("ssgd:2:graphed", "sma:2x2:branches")] == [1, 3]
    words = ["python", "bench/cuda_graphs.py", "--job", "grid", "--setups", "ssgd:2:eager,sma:2x2:branches",
             "--runs", "2"]
    assert set(DeviceStandIn(RuntimeError).grid(words)) <= set(result)   # the harness test's stand-in says no more


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
    real = json.loads((tmp_path / "train_gloo_run0.json").read_text())["result"]   # what the stand-in imitates
    stood_in = DeviceStandIn(RuntimeError).train(["dimd", "train", "--batch-size", "8", "--epochs", "2"])
    assert set(stood_in) <= set(real) and set(stood_in["history"][0]) <= set(real["history"][0])
    assert set(stood_in["allreduce_choice"]) <= set(real["allreduce_choice"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
