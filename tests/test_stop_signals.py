"""The stop signal each launcher forwards ends a training with a checkpoint, and job logs stay plain text.

Hydra (MPICH's mpiexec) forwards SIGTERM; Open MPI's mpirun kills the ranks
250 ms after a SIGTERM but forwards SIGUSR2 (docs/batch-jobs.md). CI runs
this file under both (tests/openmpi/run.sh for Open MPI).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import DIMD, launcher_is_open_mpi, mpi_command, run_mpi_dimd, signal_at


def stop_signal() -> signal.Signals:
    """The signal docs/batch-jobs.md names for this launcher."""
    return signal.SIGUSR2 if launcher_is_open_mpi() else signal.SIGTERM


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(data), "--val", str(data), "--model", "lenet", "--image-size", "32",
            "--batch-size", "4", "--lr", "0.05", "--no-lr-scaling", "--allreduce", "ring", "--decode-workers", "1",
            "--checkpoint-dir", str(out / "checkpoints"), "--json", str(out / "train.json"), *extra]


@pytest.mark.mpi
def test_the_launchers_stop_signal_checkpoints_and_exits_0_and_the_log_holds_no_nul(packed_sample, tmp_path):
    """A batch log: the job's stdout and stderr in one file, not a terminal.

    Open MPI's version string ends in a NUL (grep would call the whole log binary), and the
    progress line on stderr must end before the next line on stdout begins (not "eta 17sstopped by").
    Unbuffered, as batch environments often run Python: each write reaches the launcher by itself, so
    a line written in two pieces (print's text, then its newline) lets stdout's next line in between.
    """
    sig = stop_signal()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(mpi_command(2, [*DIMD, *train_args(packed_sample, tmp_path, "--epochs", "500")], env),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # after the run's header (training starts then), to the launcher, as `kill -s SIG <launcher pid>`
    out, err = signal_at(job, "thread(s) per rank", lambda j: j.send_signal(sig))
    assert job.returncode == 0, out + err
    assert f"stopped by {sig.name}" in out
    document = (tmp_path / "train.json").read_text()
    result = json.loads(document)["result"]
    assert result["stopped_by"] == sig.name and Path(result["checkpoint"]).is_file()
    assert all("\0" not in text for text in (out, err, document))
    threads = result["threads"]
    assert threads >= 1 and f"{threads} thread(s) per rank" in out
    assert json.loads(document)["mpi"]["cores"] >= json.loads(document)["mpi"]["rank_cores"] >= 1
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("train: ")], out      # the progress line at the stop
    assert not [line for line in lines if re.search(r"eta \d+s.", line)], out
    assert [line for line in lines if line.startswith(f"stopped by {sig.name} after step")], out


@pytest.mark.mpi
def test_bench_allreduce_output_holds_no_nul(tmp_path):
    bench = run_mpi_dimd(2, "bench-allreduce", "--max-bytes", "1K", "--factor", "32", "--iters", "2",
                         "--json", tmp_path / "allreduce.json", check=True)
    for text in (bench.stdout, bench.stderr, (tmp_path / "allreduce.json").read_text()):
        assert "\0" not in text


@pytest.mark.mpi
def test_a_usage_error_is_printed_once_not_once_per_rank():
    proc = run_mpi_dimd(3, "bench-allreduce", "-q")
    assert proc.returncode != 0
    assert proc.stderr.count("No such option '-q'") == 1, proc.stderr
