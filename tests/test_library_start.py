"""dimd.init() in a user's script: the device, the threads, and one failing rank ending the whole job."""

import sys
import textwrap

import pytest
from conftest import run_mpi

import dimd

SCRIPT = textwrap.dedent("""
    import dimd
    from dimd.errors import DimdError

    comm, device = dimd.init(device="cpu")
    print(f"rank {comm.Get_rank()} of {comm.Get_size()} on {device}", flush=True)
    if comm.Get_rank() == 1:
        raise DimdError("train.dimd: no such file")
    comm.Barrier()   # rank 0 would wait here forever without the abort
""")


def test_the_library_is_reached_from_the_package_lazily():
    assert set(dimd.__all__) >= {"init", "Job", "open_loader", "Normalize", "DistributedGradients"}
    assert dimd.DistributedGradients.__module__ == "dimd.train.distributed"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        dimd.nothing  # noqa: B018


@pytest.mark.mpi
def test_an_error_on_one_rank_of_a_users_script_ends_every_rank(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    proc = run_mpi(2, sys.executable, script, timeout=120)
    assert proc.returncode != 0
    assert "rank 0 of 2 on cpu" in proc.stdout
    assert "dimd: error: rank 1: train.dimd: no such file" in proc.stderr
    assert "Traceback" not in proc.stderr   # a DimdError is one line
