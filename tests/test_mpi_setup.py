"""MPI start-up: the throttle decision, the thread level, and ending a job on any rank's error."""

import textwrap

from conftest import run_mpi
import sys

from dimd.host import available_cores
from dimd.mpi import prepare_environment

THROTTLE = "MPIR_CVAR_CH4_PROGRESS_THROTTLE"


def test_throttle_set_only_when_ranks_outnumber_cores(monkeypatch):
    monkeypatch.setattr("dimd.mpi.available_cores", lambda: 2)
    env = {"MPI_LOCALNRANKS": "4"}
    assert prepare_environment(env) and env[THROTTLE] == "1"
    env = {"MPI_LOCALNRANKS": "2"}
    assert not prepare_environment(env) and THROTTLE not in env
    env = {"MPI_LOCALNRANKS": "4", THROTTLE: "0"}
    assert not prepare_environment(env)  # the user's choice wins


JOB = textwrap.dedent("""
    import sys, click
    from dimd.commands.mpi_job import mpi_command
    from dimd.errors import DimdError

    def say(line):  # one write per line: ranks share stdout
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

    @click.command()
    @click.option("--fail-on", type=int)
    @mpi_command("funneled")
    def job(fail_on, comm, mpi_setup):
        say(f"level {mpi_setup.thread_level_provided} throttle {mpi_setup.progress_throttle}")
        if comm.rank == fail_on:
            raise DimdError("bad input on this rank")
        comm.Barrier()  # the other ranks wait here: they must not hang
        say(f"done {comm.rank}")

    job()
""")


def test_error_on_one_rank_ends_the_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = run_mpi(3, sys.executable, script, "--fail-on", "2", timeout=60)
    assert proc.returncode != 0
    assert "dimd: error: rank 2: bad input on this rank" in proc.stderr
    assert "done" not in proc.stdout


def test_clean_job_reports_thread_level_and_throttle(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = run_mpi(4, sys.executable, script, timeout=60, check=True)
    oversubscribed = 4 > available_cores()
    assert proc.stdout.count(f"level funneled throttle {oversubscribed}") == 4
    assert proc.stdout.count("done") == 4
