"""`mpirun dimd bench-allreduce` as a user runs it: the table, the check, the JSON, the errors, and rows
labelled with whole elements of the size asked for."""

import json
import time

import pytest
import torch
from conftest import invoke_dimd, mpi_run, run_mpi_dimd, run_python
from hostile import mpi_error, one_error_line
from mpi_case import case, say, world

from dimd.allreduce import STANDALONE
from dimd.allreduce.bench import BenchConfig, message_sizes
from dimd.errors import ConfigError


@pytest.mark.mpi
def test_checked_sweep_of_every_algorithm_writes_table_and_json(tmp_path):
    out = tmp_path / "allreduce.json"
    proc = run_mpi_dimd(2, "bench-allreduce", "--check", "--min-bytes", "8", "--max-bytes", "64K",
                        "--factor", "8", "--iters", "3", "--warmup", "1", "--json", out, timeout=120)
    assert proc.returncode == 0, proc.stderr
    header = [line for line in proc.stdout.splitlines() if "busbw" in line and "algorithm" in line]
    assert len(header) == 1  # printed once, by rank 0
    assert "# check: 0 wrong elements in 40 rows" in proc.stdout

    doc = json.loads(out.read_text())
    assert doc["command"] == "bench-allreduce" and doc["result"]["world_size"] == 2
    assert doc["mpi"]["thread_level_provided"] == "serialized"
    assert "progress_throttle" in doc["mpi"] and doc["versions"]["mpi"].startswith(("MPICH", "Open MPI"))
    assert doc["versions"]["mpi"] == doc["mpi"]["library_version"] and "\0" not in out.read_text()
    assert doc["parameters"]["algorithms"] == list(STANDALONE)
    rows = doc["result"]["rows"]
    assert [r["bytes"] for r in rows[:: len(STANDALONE)]] == [8, 64, 512, 4096, 32768]
    assert {r["algorithm"] for r in rows} == set(STANDALONE)
    for row in rows:
        assert row["wrong"] == 0 and row["iters"] == 3
        assert row["count"] * 4 == row["bytes"] and row["dtype"] == "float32"
        assert row["min_us"] <= row["time_us"] <= row["max_us"]
        assert abs(row["busbw_gbs"] - row["algbw_gbs"]) < 1e-12  # 2(P-1)/P = 1 at P = 2
        if row["algorithm"] == "mpi":
            assert row["vs_mpi"] == 1.0
    for row in rows:  # each row is also a line of the table
        assert f"{row['bytes']:>10} {row['count']:>10} float32 {row['algorithm']:>18}" in proc.stdout


@pytest.mark.mpi
def test_three_ranks_odd_sizes_and_integer_dtype(tmp_path):
    out = tmp_path / "ar.json"
    proc = run_mpi_dimd(3, "bench-allreduce", "--check", "-a", "ring,multicolor,rabenseifner",
                        "-b", "0", "-e", "1K", "-f", "4", "-d", "int64", "-n", "2", "--colors", "2",
                        "--segment-bytes", "64", "--json", out, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    rows = doc["result"]["rows"]
    assert sorted({r["bytes"] for r in rows}) == [0, 8, 32, 128, 512]  # after 0: one int64, x4
    assert all(r["wrong"] == 0 and r["dtype"] == "int64" for r in rows)
    assert all(r["vs_mpi"] is None for r in rows)  # mpi not measured in this run
    big = [r for r in rows if r["bytes"] == 512 and r["time_us"] > 0]
    assert all(abs(r["busbw_gbs"] - r["algbw_gbs"] * 4 / 3) < 1e-9 for r in big)


@pytest.mark.mpi
def test_gloo_peer_in_the_same_job(tmp_path):
    out = tmp_path / "gloo.json"
    proc = run_mpi_dimd(2, "bench-allreduce", "--check", "-a", "mpi,ring", "--peer", "gloo",
                        "-b", "1K", "-e", "16K", "-f", "4", "-n", "3", "--json", out, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["result"]["rows"]
    gloo = [r for r in rows if r["algorithm"] == "gloo"]
    assert len(gloo) == 3 and all(r["wrong"] == 0 and r["vs_mpi"] > 0 for r in gloo)


@pytest.mark.mpi
def test_unknown_algorithm_is_one_usage_error_before_mpi_starts():
    proc = run_mpi_dimd(2, "bench-allreduce", "--algorithms", "mpi,nope", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("algorithm 'nope' is not one of mpi, ring,") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "MPI_Abort" not in proc.stderr


@pytest.mark.mpi
def test_unknown_model_is_one_usage_error_on_every_rank_once():
    proc = run_mpi_dimd(2, "bench-allreduce", "--model", "nope", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("Invalid value for '--model': 'nope' is not one of 'lenet',") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "MPI_Abort" not in proc.stderr and proc.stdout == ""


@pytest.mark.mpi
def test_bad_size_range_is_refused():
    proc = run_mpi_dimd(1, "bench-allreduce", "--min-bytes", "1M", "--max-bytes", "1K", timeout=60)
    assert proc.returncode == 2  # a usage error, named by its flag
    assert "Invalid value for '--min-bytes': must not exceed the largest size (got 1048576 > 1024)" in proc.stderr


def test_help_says_how_time_is_measured():
    text = " ".join(invoke_dimd("bench-allreduce", "--help", check=True).stdout.split())
    assert "busbw = algbw x 2(P-1)/P" in text
    assert "the average over ranks with the minimum and maximum" in text


def test_message_sizes_follow_nccl_tests():
    assert message_sizes(8, 64, 2) == [8, 16, 32, 64]
    assert message_sizes(0, 4, 2) == [0, 1, 2, 4]
    assert message_sizes(0, 64, 4, itemsize=8) == [0, 8, 32]  # whole elements only
    assert message_sizes(1 << 10, 1 << 20, 32) == [1 << 10, 1 << 15, 1 << 20]


@pytest.mark.mpi
@pytest.mark.parametrize("args, dtype, size, got", [
    (["-b", "7", "-e", "64"], "float32", 4, 7),
    (["-b", "12", "-e", "64", "-d", "float64"], "float64", 8, 12),
    (["-b", "1", "-e", "64", "-d", "int32"], "int32", 4, 1),
])
def test_bench_allreduce_sizes_are_whole_elements(args, dtype, size, got):
    proc = run_mpi_dimd(1, "bench-allreduce", "-a", "mpi", *args, timeout=120)
    assert one_error_line(proc, code=2) == (
        f"Invalid value for '--min-bytes': must be a whole number of {dtype} elements, a multiple of "
        f"{size} bytes (got {got}): a row is labelled with the bytes it reduces")


@pytest.mark.mpi
def test_bench_allreduce_rows_are_labelled_with_the_size_asked_for(tmp_path):
    proc = run_mpi_dimd(1, "bench-allreduce", "-a", "mpi", "-b", "0", "-e", "40", "-f", "5", "-n", "2",
                        "--json", tmp_path / "ar.json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    rows = json.loads((tmp_path / "ar.json").read_text())["result"]["rows"]
    assert [r["bytes"] for r in rows] == [0, 4, 20] and [r["count"] for r in rows] == [0, 1, 5]


@pytest.mark.mpi
def test_a_models_gradient_row_is_whole_elements_or_refused():
    """lenet with 3 classes has an odd count of float32 gradients: no whole number of float64 elements."""
    proc = run_mpi_dimd(1, "bench-allreduce", "-a", "mpi", "-b", "8", "-e", "8", "--model", "lenet",
                        "--classes", "3", "-d", "float64", timeout=120)
    assert one_error_line(proc, code=2) == (
        "Invalid value for '--model': lenet's gradients (245644 bytes of float32) are not a whole number of "
        "float64 elements; time them with --dtype float32, as dimd train allreduces them")


def test_extra_sizes_must_be_whole_elements():
    with pytest.raises(ConfigError, match=r"extra_sizes must be whole numbers of int64 elements, multiples of 8 "
                                          r"bytes \(got 12\)"):
        BenchConfig(dtype="int64", extra_sizes=(16, 12))
    assert BenchConfig(dtype="int32", max_bytes=8, extra_sizes=(12,)).sizes() == [8, 12]


@case
def tensor_sweep_through_a_group(algorithms: str) -> None:
    """``bench-allreduce --device cuda``'s sweep on CPU tensors, through gloo instead of NCCL: per row one JSON
    line from rank 0 (checked against the known sums; the copies alone are not)::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py tensor_sweep_through_a_group mpi,ring
        -> {"bytes": 0, "algorithm": "gloo", ..., "wrong": 0} ...
    """
    import dataclasses

    import numpy as np
    import torch

    from dimd.allreduce import start_group
    from dimd.allreduce.bench import TensorBuffers, sweep, tensor_reducers

    comm = world("serialized")
    device = torch.device("cpu")
    with start_group(comm, "gloo") as group:
        reducers = tensor_reducers(comm, algorithms.split(","), {}, group, device)
        rows = sweep(comm, reducers, [0, 8, 4096, 100_004], np.dtype(np.float32), iters=2, warmup=1, check=True,
                     buffers=TensorBuffers(device))
    if comm.Get_rank() == 0:
        for row in rows:
            say(json.dumps(dataclasses.asdict(row)))


@pytest.mark.mpi
def test_device_buffers_time_the_collective_the_copies_and_each_algorithm_with_them():
    """What --device cuda times, on CPU tensors through gloo (the backend the only difference): every row
    sums right, the copies alone are a row of their own, each host algorithm is timed between them."""
    proc = mpi_run(tensor_sweep_through_a_group, 2, "mpi,ring", timeout=120, check=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["bytes"], r["algorithm"]) for r in rows] == [
        (size, name) for size in (0, 8, 4096, 100_004) for name in ("gloo", "d2h+h2d", "mpi", "ring")]
    assert all(r["wrong"] == (None if r["algorithm"] == "d2h+h2d" else 0) for r in rows), rows
    assert all(r["vs_mpi"] > 0 for r in rows if r["bytes"])


@pytest.mark.mpi
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_device_cuda_without_cuda_is_one_line_and_exit_2():
    proc = run_mpi_dimd(2, "bench-allreduce", "--device", "cuda", "-b", "8", "-e", "8", timeout=120)
    message = mpi_error(proc)   # whatever the launcher adds around it (Open MPI's box about the exit)
    assert proc.returncode == 2 and proc.stderr.count("dimd: error:") == 1, proc.stderr
    assert message.startswith("--device cuda: no CUDA device on ") and "without --device cuda" in message
    assert proc.stdout == ""


def test_a_stalled_rendezvous_speaks_its_line_while_torchs_cpp_logging_stays_silenced(tmp_path):
    """The watchdog's line reaches stderr; a C++ retry log written after it (file descriptor 2) does not."""
    script = tmp_path / "speak.py"
    script.write_text("import os, sys\n"
                      "from dimd.allreduce.group import SilencedStderr\n"
                      "with SilencedStderr() as quiet:\n"
                      "    os.write(2, b'[W] TCPStore.cpp: retrying\\n')\n"
                      "    quiet.speak()\n"
                      "    sys.stderr.write('dimd: error: the one line\\n')\n"
                      "    os.write(2, b'[W] TCPStore.cpp: retrying again\\n')\n"
                      "os.write(2, b'stderr is back\\n')\n")
    proc = run_python(script, check=True, timeout=60)
    assert proc.stderr == "dimd: error: the one line\nstderr is back\n"


@pytest.mark.mpi
def test_a_rendezvous_that_cannot_complete_ends_the_job_in_one_line_within_the_timeout():
    """rank 0's address answers nobody (TEST-NET-1, RFC 5737): the job ends after --stall-timeout with one line
    from rank 0, none of torch's C++ retry logs, no traceback."""
    start = time.monotonic()
    proc = run_mpi_dimd(2, "bench-allreduce", "--peer", "gloo", "-a", "mpi", "-b", "8", "-e", "8",
                        "--stall-timeout", "3", env={"MASTER_ADDR": "192.0.2.1"},
                        timeout=120)
    message = mpi_error(proc)   # whatever the launcher adds around it (MPICH's abort notice, Open MPI's boxes)
    assert proc.returncode == 1 and proc.stderr.count("dimd: error:") == 1, proc.stderr
    assert message.startswith("rank 0 on ") and "gloo's rendezvous did not complete: no progress for 3 s" in message
    assert "MASTER_ADDR" in message and "--stall-timeout bounds this wait" in message
    assert "c10d" not in proc.stderr and time.monotonic() - start < 60
