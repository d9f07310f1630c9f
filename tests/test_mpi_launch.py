"""MPI start-up under batch schedulers: the singleton trap is refused, early stop signals are kept.

The environments below are what a real SLURM 22.05 sets
(docs/batch-jobs.md#mpi-under-slurm-one-job-not-n-singletons); tests/slurm/run.sh checks
the same on a real cluster.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from conftest import DIMD, mpi_run, run_dimd, run_mpi
from mpi_case import case
from dimd.mpi import launch_mismatch

MPICH = "MPICH Version:      5.0.2"
PLAIN_SRUN = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}


def test_plain_srun_of_two_tasks_is_the_trap_and_says_what_to_do():
    problem = launch_mismatch(1, MPICH, PLAIN_SRUN)
    assert problem is not None and problem.first_task
    text = str(problem)
    assert text.startswith("srun started 2 processes (SLURM_STEP_NUM_TASKS=2) but MPICH 5.0.2 "
                           "gives each a world of 1 rank")
    assert "`srun --mpi=pmi2`" in text and "SLURM_MPI_TYPE=pmi2" in text and "a site MPI" in text
    assert "\n" not in text
    assert not launch_mismatch(1, MPICH, {**PLAIN_SRUN, "SLURM_PROCID": "1"}).first_task


@pytest.mark.parametrize("world, env", [
    (2, {**PLAIN_SRUN, "SLURM_MPI_TYPE": "pmi2", "PMI_SIZE": "2"}),    # srun --mpi=pmi2
    (2, {**PLAIN_SRUN, "SLURM_STEP_NUM_TASKS": "1", "PMI_SIZE": "2"}),  # mpiexec -n 2 inside salloc
    (1, {**PLAIN_SRUN, "SLURM_STEP_NUM_TASKS": "1"}),                   # srun -n 1, on purpose
    (1, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}),                    # the batch script itself
    (1, {**PLAIN_SRUN, "PMI_SIZE": "1"}),                               # a launcher wired a world of 1
    (1, {}),                                                            # no launcher at all
    (4, {"JSM_NAMESPACE_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "4"}),      # jsrun, right MPI
], ids=["srun-pmi2", "mpiexec-in-allocation", "srun-n1", "batch-step", "wired-1", "bare", "jsrun"])
def test_real_launches_pass(world, env):
    assert launch_mismatch(world, MPICH, env) is None


@pytest.mark.parametrize("env, launcher", [
    ({"JSM_NAMESPACE_SIZE": "4", "JSM_NAMESPACE_RANK": "0"}, "jsrun started 4"),
    ({"FLUX_JOB_SIZE": "3", "FLUX_TASK_RANK": "0"}, "flux run started 3"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "Open MPI's mpirun started 2"),
    ({"PMI_SIZE": "2", "PMI_RANK": "0"}, "the launcher's PMI started 2"),
    ({**PLAIN_SRUN, "SLURM_MPI_TYPE": "pmix"}, "srun --mpi=pmix"),
    ({"PMIX_RANK": "3"}, "rank 3 (PMIX_RANK=3)"),
])
def test_other_launchers_that_start_singletons_are_named(env, launcher):
    problem = launch_mismatch(1, "Open MPI v4.1.5, package: Open MPI", env)
    assert problem is not None and launcher in str(problem)
    assert problem.first_task == ("PMIX_RANK" not in env)   # rank 1 speaks for PMIx: rank 0 cannot tell


def test_every_mpi_command_stops_at_start_under_plain_srun(tmp_path):
    """What each of a plain `srun -n 2`'s tasks sees: task 0 says why and fails, task 1 leaves it to task 0."""
    env = {**os.environ, **PLAIN_SRUN}
    for command in (["train", tmp_path / "missing", "--val", tmp_path / "missing"],
                    ["shuffle", tmp_path / "missing"], ["bench-allreduce", "--max-bytes", "64"]):
        proc = run_dimd(*command, env=env, timeout=120)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dimd: error: srun started 2 processes"), lines
        assert proc.stdout == ""   # nothing ran: not the data check, not one benchmark row
    proc = run_dimd("bench-allreduce", env={**env, "SLURM_PROCID": "1"}, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == ""   # exit 1 could cut task 0 off


def test_open_mpis_mpirun_over_an_mpich_build_is_one_line():
    """mpi4py warns in three lines of its own on each process; dimd's one line says what is wrong and what to do."""
    env = {**os.environ, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    proc = run_dimd("bench-allreduce", "--max-bytes", "64", env=env, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dimd: error: Open MPI's mpirun started 2 processes"), lines


@pytest.mark.mpi
def test_mpiexec_inside_an_allocation_runs():
    env = {**PLAIN_SRUN, "SLURM_STEP_NUM_TASKS": "1"}   # one Hydra proxy per node, started by srun
    proc = run_mpi(2, *DIMD, "bench-allreduce", "--max-bytes", "64", "--algorithms", "mpi",
                   env=env, timeout=120, check=True)
    assert "mpi" in proc.stdout


@case
def dimd_warned_right_after_mpi_starts(ranks: str, *args: str) -> None:
    """``dimd ARGS``, with a SIGUSR1 (a scheduler's time-limit warning) sent just after MPI_Init to each rank
    of RANKS (``all``, or comma-separated ranks: the warning reaching the others later, or never).

    MPI_Init puts its own handler on SIGUSR1; dimd's must already be there, so the run stops cleanly::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py dimd_warned_right_after_mpi_starts all train data ...
        -> stopped by SIGUSR1 after step 1; checkpoint ...
    """
    import os
    import signal

    from dimd.cli import main
    from dimd.commands import mpi_job

    started = mpi_job.init_mpi

    def init_then_warn(level: Any) -> Any:
        setup = started(level)
        from mpi4py import MPI

        if ranks == "all" or str(MPI.COMM_WORLD.Get_rank()) in ranks.split(","):
            os.kill(os.getpid(), signal.SIGUSR1)
        return setup

    mpi_job.init_mpi = init_then_warn
    main(list(args), prog_name="dimd")


@pytest.mark.mpi
@pytest.mark.parametrize("warned", ["all", "1"])
def test_a_warning_right_after_mpi_starts_is_not_lost_and_is_named_on_every_rank(packed_sample, tmp_path, warned):
    """MPI_Init puts its own handler on SIGUSR1; dimd's must already be there (and after it). A warning
    that reached rank 1 only is still SIGUSR1 in rank 0's result: bin/'s scripts requeue on that name."""
    proc = mpi_run(dimd_warned_right_after_mpi_starts, 2, warned, "train", packed_sample, "--val", packed_sample,
                   "--model", "lenet", "--image-size", "32", "--epochs", "50", "--batch-size", "8",
                   "--decode-workers", "1", "--threads", "1", "--checkpoint-dir", tmp_path / "ck",
                   "--json", tmp_path / "train.json", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stopped by SIGUSR1 after step 1" in proc.stdout
    result = json.loads((tmp_path / "train.json").read_text())["result"]
    assert result["stopped_by"] == "SIGUSR1"
    assert torch.load(result["checkpoint"], weights_only=True)["step"] == 1


@pytest.mark.mpi
def test_a_stop_without_a_checkpoint_folder_says_nothing_was_saved(packed_sample, tmp_path):
    proc = mpi_run(dimd_warned_right_after_mpi_starts, 2, "all", "train", packed_sample, "--val", packed_sample,
                   "--model", "lenet", "--image-size", "32", "--epochs", "50", "--batch-size", "8",
                   "--decode-workers", "1", "--threads", "1", "--json", tmp_path / "train.json", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("stopped by SIGUSR1 after step 1; no checkpoint written (no --checkpoint-dir): a new run starts over"
            in proc.stdout)
    assert json.loads((tmp_path / "train.json").read_text())["result"]["checkpoint"] is None
