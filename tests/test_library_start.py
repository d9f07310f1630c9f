"""dimd.init() in a user's script: the device, the threads, and one failing rank ending the whole job."""

import os
import sys
import textwrap

import pytest
import torch
from conftest import run_mpi, run_mpi_watched, run_python

import dimd
import dimd.shuffle

SCRIPT = textwrap.dedent("""
    import sys
    import dimd
    from dimd.errors import DimdError

    comm, device = dimd.init(device="cpu")
    sys.stdout.write(f"rank {comm.Get_rank()} of {comm.Get_size()} on {device}\\n")   # one write: the ranks
    sys.stdout.flush()                                                                 # share the launcher's stdout
    if comm.Get_rank() == 1:
        raise DimdError("train.dimd: no such file")
    comm.Barrier()   # rank 0 would wait here forever without the abort
""")


LOST_PEER = textwrap.dedent("""
    import socket, sys, time
    import torch, torch.nn.functional as F
    import dimd

    comm, device = dimd.init(device="cpu")
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dimd.DistributedGradients(model, optimizer=optimizer, algorithm="ring", stall_timeout=1)
    sys.stdout.write(f"rank {comm.Get_rank()} on {socket.gethostname()}\\n")   # one write: not split by
    sys.stdout.flush()                                                        # the other rank's line
    if comm.Get_rank() == 1:
        time.sleep(120)   # alive, but gone as far as the job can tell: a peer whose host left the network
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    optimizer.step()      # waits for the gradients' allreduce, which rank 1 never joins
""")


OTHER_MODEL = textwrap.dedent("""
    import torch
    import dimd

    comm, device = dimd.init(device="cpu")
    layers = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    if comm.Get_rank() == 1:
        layers += [torch.nn.ReLU(), torch.nn.Linear(2, 2)]   # one layer more: one broadcast more
    dimd.DistributedGradients(torch.nn.Sequential(*layers), algorithm="ring")
""")


LEAVES_EARLY = textwrap.dedent("""
    import sys
    import dimd

    comm, device = dimd.init(device="cpu", stall_timeout=2)
    if comm.Get_rank() == 1:
        sys.exit(3)       # a check of its own fails: SystemExit reaches no exception hook
    comm.Barrier()        # rank 0 waits here for rank 1
""")


def run_users_script(tmp_path, text: str, timeout: float):
    """``text`` as a user's script on 2 ranks under the launcher."""
    script = tmp_path / "user_script.py"
    script.write_text(text)
    return run_mpi(2, sys.executable, script, timeout=timeout)


def test_the_library_is_reached_from_the_package_lazily():
    assert set(dimd.__all__) >= {"init", "Job", "open_loader", "Normalize", "DistributedGradients"}
    assert dimd.DistributedGradients.__module__ == "dimd.train.distributed"
    assert dimd.open_loader is dimd.shuffle.open_loader   # the data path lives in dimd.shuffle
    assert dimd.Normalize is dimd.shuffle.Normalize
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        dimd.nothing  # noqa: B018


@pytest.mark.mpi
def test_an_error_on_one_rank_of_a_users_script_ends_every_rank(tmp_path, mpi_leaves_no_files):
    proc = run_users_script(tmp_path, SCRIPT, timeout=120)
    assert proc.returncode != 0
    assert "rank 0 of 2 on cpu" in proc.stdout
    assert "dimd: error: rank 1: train.dimd: no such file" in proc.stderr
    assert "Traceback" not in proc.stderr   # a DimdError is one line


def test_a_users_script_run_without_a_launcher_says_its_error_in_one_line(tmp_path):
    """``python my_script.py``, a world of one rank: the same line as under the launcher, no traceback."""
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT.replace("comm.Get_rank() == 1", "True"))
    proc = run_python(script, timeout=120)
    assert (proc.returncode, proc.stdout) == (1, "rank 0 of 1 on cpu\n")
    assert proc.stderr == "dimd: error: train.dimd: no such file\n"


@pytest.mark.mpi
def test_a_peer_that_stops_answering_ends_a_users_script_with_one_line(tmp_path, mpi_leaves_no_files):
    proc = run_users_script(tmp_path, LOST_PEER, timeout=60)
    assert proc.returncode != 0
    host = next(line.split(" on ")[1] for line in proc.stdout.splitlines() if line.startswith("rank 0 on "))
    assert (f"dimd: error: rank 0 on {host}: no progress for 1 s in the gradients' allreduce of step 1; a peer "
            "may be unreachable (`stall_timeout` sets how long a rank waits for the others") in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("script, line, in_order", [
    (OTHER_MODEL, "dimd: error: rank 1's model differs from rank 0's: 6 parameters and buffers against 4 (the "
                  "first one only on rank 1: 4.weight [2, 2] float32); build the same model", True),
    (LEAVES_EARLY, "dimd: error: rank 1: this rank's script ended, but after 2 s some ranks have not (they may "
                   "wait for this one in a collective); ending the job (`stall_timeout` of dimd.init() sets the "
                   "wait)", False),
], ids=["a model that differs between ranks", "one rank that leaves early"])
def test_a_script_that_goes_astray_on_one_rank_ends_the_job_with_one_line(tmp_path, script, line, in_order,
                                                                         mpi_leaves_no_files):
    """Every rank found the model different alike: one line, and the ranks leave through MPI_Finalize, not
    MPI_Abort (whose hydra leaves its topology file behind); a rank that leaves alone gets the job aborted."""
    script_path = tmp_path / "user_script.py"
    script_path.write_text(script)
    proc, hydra_files = run_mpi_watched(2, sys.executable, str(script_path), timeout=60)
    assert proc.returncode != 0
    assert [text for text in proc.stderr.splitlines() if text.startswith("dimd:")] == [line]
    if in_order:   # neither MPICH's nor Open MPI's abort notice
        assert "Abort(" not in proc.stdout + proc.stderr and "MPI_ABORT" not in proc.stdout + proc.stderr
        assert hydra_files or os.environ.get("MPIEXEC"), "the test saw no hydra topology file to check"
        assert not [path for path in hydra_files if os.path.exists(path)]


@pytest.mark.mpi
def test_a_failing_exit_on_one_rank_under_python_m_mpi4py_ends_the_job_at_once(tmp_path, mpi_leaves_no_files):
    """mpi4py's runner aborts the job after ``sys.exit("...")``; dimd's exit watch must not wait its 600 s first."""
    script = tmp_path / "user_script.py"
    script.write_text(LEAVES_EARLY.replace("stall_timeout=2", "stall_timeout=600").replace("sys.exit(3)",
                                                                                          'sys.exit("gave up")'))
    proc = run_mpi(2, sys.executable, "-m", "mpi4py", script, timeout=60)
    assert proc.returncode != 0
    assert "gave up" in proc.stderr and "dimd:" not in proc.stderr


@pytest.mark.mpi
def test_an_error_every_rank_raises_under_python_m_mpi4py_ends_the_job_in_order(tmp_path, mpi_leaves_no_files):
    """mpi4py's runner asks for MPI_Abort after any uncaught exception; dimd takes that back for an error
    every rank raised alike, so the job still leaves through MPI_Finalize."""
    script = tmp_path / "user_script.py"
    script.write_text(OTHER_MODEL)
    proc, hydra_files = run_mpi_watched(2, sys.executable, "-m", "mpi4py", str(script), timeout=60)
    assert proc.returncode != 0
    assert [text for text in proc.stderr.splitlines() if text.startswith("dimd:")] == [
        "dimd: error: rank 1's model differs from rank 0's: 6 parameters and buffers against 4 (the first one "
        "only on rank 1: 4.weight [2, 2] float32); build the same model"]
    assert "Abort(" not in proc.stdout + proc.stderr and "MPI_ABORT" not in proc.stdout + proc.stderr
    assert hydra_files or os.environ.get("MPIEXEC"), "the test saw no hydra topology file to check"
    assert not [path for path in hydra_files if os.path.exists(path)]


def test_distributed_gradients_refuses_parameters_that_are_not_float32_in_one_line(world):
    with pytest.raises(dimd.errors.DimdError, match=r"reduces dense float32 parameters on one device; weight is "
                                                    r"torch.bfloat16 on cpu \(keep the weights in float32"):
        dimd.DistributedGradients(torch.nn.Linear(2, 2).to(torch.bfloat16), world)


def test_distributed_gradients_refuses_a_negative_stall_timeout():
    with pytest.raises(dimd.errors.DimdError, match="stall_timeout must be 0"):
        dimd.DistributedGradients(torch.nn.Linear(2, 2), stall_timeout=-1)
