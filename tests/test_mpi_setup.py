"""MPI start-up (the throttle decision, the thread level), ending a job on any rank's error, and the test harness."""

import mmap
import os
import subprocess
import time
from typing import Any

import pytest
from conftest import DIMD, launcher, mpi_command, mpi_run, mpiexec
from mpi_case import case, say, world
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


@case
def mpi_command_setup() -> None:
    """Under dimd's ``mpi_command``, every rank says its thread level and throttle, then ``done``.

        mpiexec -n 4 python -m mpi4py tests/mpi_case.py mpi_command_setup
        -> level funneled throttle True yield False oversubscribed True (MPICH)
           (x4, when 4 ranks outnumber the cores; under Open MPI: throttle False yield True)
           done 0 ... done 3
    """
    from dimd.commands.mpi_job import mpi_command

    @mpi_command("funneled")
    def job(comm: Any, mpi_setup: Any) -> None:
        say(f"level {mpi_setup.thread_level_provided} throttle {mpi_setup.progress_throttle} "
            f"yield {mpi_setup.yield_when_idle} oversubscribed {mpi_setup.oversubscribed} "
            f"({mpi_setup.library_version.split()[0]})")
        comm.Barrier()
        say(f"done {comm.rank}")

    job()


@pytest.mark.mpi
def test_clean_job_reports_thread_level_and_its_mpis_idle_remedy():
    """dimd starts MPI at the level asked for; when ranks outnumber cores, the remedy of the MPI that runs."""
    proc = mpi_run(mpi_command_setup, 4, timeout=60, check=True)
    oversubscribed = 4 > launcher_cores()
    mpich = "MPICH" in proc.stdout
    throttle = mpich and (oversubscribed or os.environ.get(THROTTLE) == "1")   # or set for every test job
    yields = not mpich and (oversubscribed or os.environ.get(YIELD) == "1")
    assert proc.stdout.count(f"level funneled throttle {throttle} "
                             f"yield {yields} oversubscribed {oversubscribed}") == 4
    assert proc.stdout.count("done") == 4


@case
def one_rank_fails(collective: str, failing_rank: str, dataset: str = "") -> None:
    """Under dimd's ``mpi_command``, one rank fails while the others wait in a collective.

    The collective is ``barrier`` or ``shuffle`` (the failing rank raises a
    DimdError first; the shuffle needs a packed DATASET), ``allreduce`` (the
    failing rank hands the ring a read-only buffer, and the library refuses it)
    or ``agreed-barrier`` (the failing rank alone raises an error meant to be
    raised by every rank at once, as if a handler had let the others go on;
    the ranks wait 2 s for each other, then the job is aborted).
    dimd must end the whole job with that rank's one-line error, no rank says ``done``::

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py one_rank_fails barrier 2
        -> stderr: dimd: error: rank 2: gives up before the barrier
        mpiexec -n 3 python -m mpi4py tests/mpi_case.py one_rank_fails shuffle 1 packed/sample
        mpiexec -n 3 python -m mpi4py tests/mpi_case.py one_rank_fails allreduce 2
        -> stderr: dimd: error: rank 2: allreduce needs a writeable buffer
    """
    import numpy as np

    from dimd.allreduce import allreduce
    from dimd.commands import mpi_job
    from dimd.commands.mpi_job import mpi_command
    from dimd.errors import DimdError
    from dimd.mpi import AgreedError
    from dimd.shuffle import DistributedStore

    failing = int(failing_rank)
    mpi_job.AGREED_EXIT_S = 2.0

    @mpi_command("funneled")
    def job(comm: Any, mpi_setup: Any) -> None:
        if collective == "barrier":
            if comm.rank == failing:
                raise DimdError("gives up before the barrier")
            comm.Barrier()
        elif collective == "shuffle":
            store = DistributedStore.load(dataset, comm)
            if comm.rank == failing:
                raise DimdError("gives up before the shuffle")
            store.shuffle(0, 0)                  # the others wait in its Alltoallv
        elif collective == "allreduce":
            buf = np.ones(1000)
            buf.flags.writeable = comm.rank != failing
            allreduce(buf, comm, "ring")
        elif collective == "agreed-barrier":
            if comm.rank == failing:
                raise AgreedError("gives up alone before the barrier")
            comm.Barrier()
        else:
            raise ValueError(f"no collective {collective!r}: barrier, shuffle, allreduce or agreed-barrier")
        say(f"done {comm.rank}")

    job()


@pytest.mark.mpi
@pytest.mark.parametrize("collective, rank, message", [
    ("barrier", 2, "dimd: error: rank 2: gives up before the barrier"),
    ("shuffle", 1, "dimd: error: rank 1: gives up before the shuffle"),
    ("allreduce", 2, "dimd: error: rank 2: allreduce needs a writeable buffer"),
    ("agreed-barrier", 1, "dimd: error: rank 1: gives up alone before the barrier"),
])
def test_an_error_on_one_rank_ends_the_job(packed_sample, collective, rank, message, mpi_leaves_no_files):
    """The other ranks wait in the collective: dimd must end them, not leave them hanging."""
    proc = mpi_run(one_rank_fails, 3, collective, rank, packed_sample, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "done" not in proc.stdout


@case
def agreed_only_over_the_whole_job() -> None:
    """A problem all ranks of the job raise is an AgreedError (the job may end in order); one all ranks
    of a group raise is a plain DimdError (the other groups know nothing: the job must be aborted)::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py agreed_only_over_the_whole_job
        -> agreed 0, agreed 1
    """
    from dimd.errors import DimdError
    from dimd.mpi import AgreedError, agreed

    comm = world()
    group = comm.Split(comm.rank, 0)   # a group of one rank each
    assert type(agreed(comm, "x")) is AgreedError
    assert type(agreed(group, "x")) is DimdError
    group.Free()
    say(f"agreed {comm.rank}")


@pytest.mark.mpi
def test_only_a_problem_the_whole_job_shares_lets_it_end_in_order():
    proc = mpi_run(agreed_only_over_the_whole_job, 2, timeout=60, check=True)
    assert proc.stdout.count("agreed") == 2


@pytest.mark.mpi
@pytest.mark.parametrize("refusing", [0, 1])
def test_a_usage_error_on_some_ranks_only_ends_the_whole_job_with_its_line(packed_sample, refusing):
    """``mpiexec -n 1 A : -n 1 B`` gives the ranks different command lines: the rank that refuses its own
    starts MPI all the same, so the other's shuffle, waiting in MPI_Init for it, ends with it."""
    env = dict(os.environ)
    good = [*DIMD, "shuffle", packed_sample, "--rounds", 1]
    bad = [*DIMD, "shuffle", packed_sample, "--bogus"]
    first, second = (bad, good) if refusing == 0 else (good, bad)
    job = mpi_command(1, first, env) + [":"] + mpi_command(1, second, env)[len(mpiexec()):]
    proc = subprocess.run(job, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "dimd:" in line]
    assert len(lines) == 1 and lines[0].startswith("dimd: error: No such option '--bogus'."), proc.stderr
    assert lines[0].endswith("Try 'dimd shuffle --help' for help.") and "shuffle:" not in proc.stdout


#: A user's network whose builder refuses the class count it gets (the sample set's 4).
REFUSING_NETWORK = "def build(num_classes):\n    raise ValueError(f'no network for {num_classes} classes')\n"


def a_cuda_device_is_present() -> bool:
    """Asked only when a test marked NO_CUDA runs: the ranks of this file's cases import no torch."""
    import torch

    return torch.cuda.is_available()


NO_CUDA = pytest.mark.skipif("a_cuda_device_is_present()", reason="a CUDA device is present")


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


@case
def device_auto_where_one_rank_has_cuda() -> None:
    """``auto`` on a job where only rank 1 sees CUDA (faked): the CPU on every rank, and no rank left
    waiting in the node's GPU pairing::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py device_auto_where_one_rank_has_cuda
        -> devices cpu cpu
    """
    import torch

    from dimd.train.hardware import pick_device

    comm = world()
    if comm.Get_rank() == 1:
        torch.cuda.is_available = lambda: True
    devices = comm.gather(str(pick_device("auto", comm)))
    if comm.Get_rank() == 0:
        say("devices " + " ".join(devices))


@pytest.mark.mpi
def test_device_auto_uses_the_cpu_everywhere_when_some_rank_has_no_gpu():
    proc = mpi_run(device_auto_where_one_rank_has_cuda, 2, timeout=60, check=True)
    assert "devices cpu cpu" in proc.stdout


@case
def a_peer_stops_answering(timeout: str) -> None:
    """Rank 1 stops calling collectives before step 3 (as a rank behind a dead link looks to the others).

    Rank 0 waits in step 3's allreduce; its stall watchdog ends the whole job after TIMEOUT seconds::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py a_peer_stops_answering 1
        -> stderr: dimd: error: rank 0 on HOST: no progress for 1 s in the allreduce of step 3; a peer may
           be unreachable (...)
    """
    import time

    import numpy as np
    from mpi4py import MPI

    from dimd.stall import StallWatchdog, job_ender

    comm = world("serialized")
    gradients = np.ones(1000)
    with StallWatchdog(float(timeout), job_ender(comm)) as watchdog:
        for step in (1, 2, 3):
            if comm.rank == 1 and step == 3:
                time.sleep(300)                        # gone: never reaches the allreduce
            with watchdog.waiting(f"the allreduce of step {step}"):
                comm.Allreduce(MPI.IN_PLACE, gradients)
            say(f"rank {comm.rank} step {step}")
    say(f"done {comm.rank}")


@pytest.mark.mpi
def test_a_rank_left_waiting_for_a_silent_peer_ends_the_job_with_one_line(mpi_leaves_no_files):
    """The stall watchdog: rank 1 stops answering, rank 0 names itself, its host and the wait, and the job ends."""
    proc = mpi_run(a_peer_stops_answering, 2, 1, timeout=60)
    assert proc.returncode != 0
    assert "rank 0 step 2" in proc.stdout and "done" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if "no progress" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dimd: error: rank 0 on ")
    assert "in the allreduce of step 3; a peer may be unreachable" in lines[0]


@case
def assert_fails_on_one_rank(failing_rank: str) -> None:
    """A plain ``assert`` fails on one rank while the others wait in a barrier; the harness ends the job.

    No dimd error handling is involved: ``python -m mpi4py`` aborts the job::

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py assert_fails_on_one_rank 1
        -> stderr: AssertionError: rank 1 of 3 disagrees
    """
    comm = world()
    assert comm.rank != int(failing_rank), f"rank {comm.rank} of {comm.size} disagrees"
    comm.Barrier()
    say(f"done {comm.rank}")


@pytest.mark.mpi
def test_a_failed_assert_on_one_rank_ends_the_test_job_at_once():
    """The harness itself: ``python -m mpi4py`` aborts every rank, with the assertion on stderr.

    Without it the two other ranks would wait in their barrier until the timeout.
    """
    start = time.perf_counter()
    proc = mpi_run(assert_fails_on_one_rank, 3, 1, timeout=60)
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
