"""MPI start-up (the throttle decision, the thread level), ending a job on any rank's error, and the test harness."""

import mmap
import os
import time

import pytest
import torch
from conftest import launcher, mpi_run, mpiexec
from mpi_segments import leftover_mpi_segments

from dimd.host import launcher_cores
from dimd.mpi import NodeCores, prepare_environment

THROTTLE = "MPIR_CVAR_CH4_PROGRESS_THROTTLE"
YIELD = "OMPI_MCA_mpi_yield_when_idle"


def test_idle_remedies_set_only_when_ranks_outnumber_the_launchers_cores(monkeypatch):
    monkeypatch.setattr("dimd.mpi.launcher_cores", lambda: 2)
    env = {"MPI_LOCALNRANKS": "4"}
    assert prepare_environment(env) == {"progress_throttle": True, "yield_when_idle": True}
    assert env[THROTTLE] == "1" and env[YIELD] == "1"
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert prepare_environment(env) == {"progress_throttle": False, "yield_when_idle": False}
    assert THROTTLE not in env and YIELD not in env
    env = {"MPI_LOCALNRANKS": "4", THROTTLE: "0"}
    assert not prepare_environment(env)["progress_throttle"]  # the user's choice wins


def test_threads_follow_the_binding_and_the_ranks_that_share_it():
    unbound = NodeCores(node=8, own=8, local_ranks=4, sharing=4)          # mpiexec, no binding
    assert unbound.threads == 2 and unbound.tight_binding() is None
    allotted = NodeCores(node=32, own=8, local_ranks=4, sharing=1)        # srun --cpus-per-task=8
    assert allotted.threads == 8 and allotted.tight_binding() is None
    one_core = NodeCores(node=2, own=1, local_ranks=1, sharing=1)         # Open MPI's default at -n 1
    assert one_core.threads == 1 and "--bind-to none" in one_core.tight_binding()
    crowded = NodeCores(node=2, own=2, local_ranks=4, sharing=4)
    assert crowded.threads == 1 and crowded.oversubscribed and crowded.tight_binding() is None


def test_more_threads_than_a_ranks_cores_are_taken_with_a_warning():
    two_ranks = NodeCores(node=2, own=2, local_ranks=2, sharing=2)
    assert two_ranks.too_many_threads(1) is None
    assert two_ranks.too_many_threads(1000) == ("--threads 1000 on each of 2 ranks sharing 2 core(s) outnumbers "
                                                "them, which slows the steps; leave it out for 1 per rank")
    alone = NodeCores(node=2, own=2, local_ranks=1, sharing=1)
    assert alone.too_many_threads(3) == ("--threads 3 outnumbers the 2 core(s) this rank has, which slows the "
                                         "steps; leave it out for 2")


@pytest.mark.mpi
def test_clean_job_reports_thread_level_and_its_mpis_idle_remedy():
    """dimd starts MPI at the level asked for; when ranks outnumber cores, the remedy of the MPI that runs."""
    proc = mpi_run("mpi_command_setup", 4, timeout=60, check=True)
    oversubscribed = 4 > launcher_cores()
    mpich = "MPICH" in proc.stdout
    throttle = mpich and (oversubscribed or os.environ.get(THROTTLE) == "1")   # or set for every test job
    yields = not mpich and (oversubscribed or os.environ.get(YIELD) == "1")
    assert proc.stdout.count(f"level funneled throttle {throttle} "
                             f"yield {yields} oversubscribed {oversubscribed}") == 4
    assert proc.stdout.count("done") == 4


@pytest.mark.mpi
@pytest.mark.parametrize("collective, rank, message", [
    ("barrier", 2, "dimd: error: rank 2: gives up before the barrier"),
    ("shuffle", 1, "dimd: error: rank 1: gives up before the shuffle"),
    ("allreduce", 2, "dimd: error: rank 2: allreduce needs a writeable buffer"),
    ("agreed-barrier", 1, "dimd: error: rank 1: gives up alone before the barrier"),
])
def test_an_error_on_one_rank_ends_the_job(packed_sample, collective, rank, message, mpi_leaves_no_files):
    """The other ranks wait in the collective: dimd must end them, not leave them hanging."""
    proc = mpi_run("one_rank_fails", 3, collective, rank, packed_sample, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "done" not in proc.stdout


@pytest.mark.mpi
def test_only_a_problem_the_whole_job_shares_lets_it_end_in_order():
    proc = mpi_run("agreed_only_over_the_whole_job", 2, timeout=60, check=True)
    assert proc.stdout.count("agreed") == 2


#: A user's network whose builder refuses the class count it gets (the sample set's 4).
REFUSING_NETWORK = "def build(num_classes):\n    raise ValueError(f'no network for {num_classes} classes')\n"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


@pytest.mark.mpi
@pytest.mark.parametrize("args, code, line", [
    (["train", "{data}", "--val", "{data}", "--model", "lenet", "--batch-size", "0"], 2,
     "dimd: error: Invalid value for '--batch-size': must be at least 1 (got 0)"),
    (["shuffle", "{data}", "--groups", "3"], 1,
     "dimd: error: --groups 3 does not divide the 2 ranks of the job (choose a divisor of 2)"),
    (["train", "{data}", "--val", "{data}", "--model", "lenet", "--image-size", "32", "--epochs", "1",
      "--batch-size", "8", "--decode-workers", "1", "--resume-from", "{data}.dimd"], 1,
     "dimd: error: {data}.dimd: not a readable dimd checkpoint (not the zip archive torch.save writes: "
     "truncated, overwritten or another kind of file)"),
    (["train", "{data}", "--val", "{data}", "--model", "{tmp}/missing.py:build"], 1,
     "dimd: error: --model {tmp}/missing.py:build: {tmp}/missing.py: no such file"),
    (["train", "{data}", "--val", "{data}", "--model", "{net}:make"], 1,
     "dimd: error: --model {net}:make: {net} has no callable 'make'; it defines build"),
    (["train", "{data}", "--val", "{data}", "--model", "{net}:build", "--image-size", "32", "--batch-size", "8",
      "--decode-workers", "1"], 1,
     "dimd: error: --model {net}:build: calling it with num_classes=4 raised ValueError: no network for 4 classes"),
    pytest.param(["train", "{data}", "--val", "{data}", "--model", "lenet", "--decode", "gpu"], 1,
                 "dimd: error: decode gpu needs --device cuda", marks=NO_CUDA),
    pytest.param(["train", "{data}", "--val", "{data}", "--model", "lenet", "--device", "cuda"], 1,
                 "dimd: error: device cuda: this torch build or machine has no CUDA device", marks=NO_CUDA),
])
def test_a_problem_every_rank_finds_after_mpi_started_ends_the_job_in_order(packed_sample, tmp_path, args, code,
                                                                            line, mpi_leaves_no_files):
    """An option its config refuses, groups that do not divide the ranks, a file that is no checkpoint, a
    --model whose file or callable fails, a device the machine lacks: one line from rank 0 and every rank's
    exit through MPI_Finalize, not MPI_Abort (whose hydra leaves its topology file behind)."""
    from conftest import run_mpi_dimd_watched

    net = tmp_path / "refusing_network.py"
    net.write_text(REFUSING_NETWORK)
    names = {"data": packed_sample, "tmp": tmp_path, "net": net}
    proc, hydra_files = run_mpi_dimd_watched(2, *[a.format(**names) for a in args], timeout=120)
    assert proc.returncode == code
    assert [text for text in proc.stderr.splitlines() if "dimd:" in text or "Abort" in text] == [
        line.format(**names)]
    assert hydra_files or os.environ.get("MPIEXEC"), "the test saw no hydra topology file to check"
    assert not [path for path in hydra_files if os.path.exists(path)]


@pytest.mark.mpi
def test_device_auto_uses_the_cpu_everywhere_when_some_rank_has_no_gpu():
    proc = mpi_run("device_auto_where_one_rank_has_cuda", 2, timeout=60, check=True)
    assert "devices cpu cpu" in proc.stdout


@pytest.mark.mpi
def test_a_rank_left_waiting_for_a_silent_peer_ends_the_job_with_one_line(mpi_leaves_no_files):
    """The stall watchdog: rank 1 stops answering, rank 0 names itself, its host and the wait, and the job ends."""
    proc = mpi_run("a_peer_stops_answering", 2, 1, timeout=60)
    assert proc.returncode != 0
    assert "rank 0 step 2" in proc.stdout and "done" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if "no progress" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dimd: error: rank 0 on ")
    assert "in the allreduce of step 3; a peer may be unreachable" in lines[0]


@pytest.mark.mpi
def test_a_failed_assert_on_one_rank_ends_the_test_job_at_once():
    """The harness itself: ``python -m mpi4py`` aborts every rank, with the assertion on stderr.

    Without it the two other ranks would wait in their barrier until the timeout.
    """
    start = time.perf_counter()
    proc = mpi_run("assert_fails_on_one_rank", 3, 1, timeout=60)
    seconds = time.perf_counter() - start
    assert proc.returncode != 0
    assert "AssertionError: rank 1 of 3 disagrees" in proc.stderr, proc.stderr
    assert "done" not in proc.stdout
    print(f"the job ended {seconds:.1f} s after it started")  # shown with -s; no wall-clock assert


def test_mpiexec_honours_a_launcher_with_its_own_options(monkeypatch):
    """``MPIEXEC="srun --mpi=pmi2" pytest`` runs every MPI test through the site's launcher."""
    monkeypatch.setenv("MPIEXEC", "srun --mpi=pmi2")
    assert mpiexec() == ["srun", "--mpi=pmi2"]
    monkeypatch.setenv("MPIEXEC", "'/opt/my mpi/bin/mpirun' --oversubscribe")
    assert mpiexec() == ["/opt/my mpi/bin/mpirun", "--oversubscribe"]
    monkeypatch.delenv("MPIEXEC")
    assert mpiexec()[0].endswith("mpiexec")


def test_a_test_that_starts_ranks_must_be_marked_mpi():
    """This test is not marked, so it may not start ranks: ``pytest -m "not mpi"`` must mean it."""
    with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.mpi"):
        launcher(2)


@pytest.mark.parametrize("name", ["/dev/shm/mpich_shm_dimdtest_{pid}_{use}",
                                  "/dev/shm/sm_segment.dimdtest.0.{pid}.{use}",
                                  "/tmp/hydra_hwloc_xmlfile_dimdtest{pid}{use}"])
def test_the_harness_finds_the_files_killed_mpi_jobs_left_but_not_those_in_use(name):
    started = time.time()
    left, used = (name.format(pid=os.getpid(), use=use) for use in ("left", "used"))
    try:
        for path in (left, used):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        with open(used, "r+b") as f, mmap.mmap(f.fileno(), 4096):
            found = {str(path) for path in leftover_mpi_segments(started)}
            assert left in found and used not in found
    finally:
        for path in (left, used):
            os.unlink(path)
