"""Which allreduce `dimd train` takes on GPUs, and what it refuses: NCCL where every rank has a GPU of its own."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import invoke_dimd, mpi_run
from mpi_case import case, say, world

from dimd.errors import ConfigError
from dimd.train.config import TrainConfig


@case
def nccl_by_default_where_every_rank_has_its_gpu() -> None:
    """``dimd train``'s choice of allreduce on GPUs, with the GPUs faked (torch.device("cuda", i) and NCCL said
    to be there): nccl where every rank has a GPU of its own, the fastest host algorithm (and why) where two
    ranks share one or the build has no NCCL. Rank 0 prints one JSON line per case::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py nccl_by_default_where_every_rank_has_its_gpu
    """
    import torch
    import torch.distributed as dist

    from dimd.train.config import TrainConfig
    from dimd.train.run_plan import choose_allreduce

    comm = world()
    rank = comm.Get_rank()
    config = TrainConfig(train="unused", val="unused")
    build_has_nccl = dist.is_nccl_available()
    choices = {}
    dist.is_nccl_available = lambda: True
    try:
        choices["own"] = choose_allreduce(config, 4096, comm, torch.device("cuda", rank))
        choices["shared"] = choose_allreduce(config, 4096, comm, torch.device("cuda", 0))
    finally:
        dist.is_nccl_available = lambda: build_has_nccl
    if not build_has_nccl:
        choices["no_nccl"] = choose_allreduce(config, 4096, comm, torch.device("cuda", rank))
    choices["cpu"] = choose_allreduce(config, 4096, comm, torch.device("cpu"))
    if rank == 0:
        for name, (algorithm, choice) in choices.items():
            say(json.dumps({"case": name, "algorithm": algorithm, **choice}))


@pytest.mark.mpi
def test_nccl_is_the_default_where_every_rank_has_a_gpu_of_its_own_and_the_json_says_why_not_elsewhere():
    proc = mpi_run(nccl_by_default_where_every_rank_has_its_gpu, 2, timeout=120, check=True)
    choices = {line["case"]: line for line in map(json.loads, proc.stdout.splitlines())}
    assert choices["own"] == {"case": "own", "algorithm": "nccl",
                              "how": "the default on GPUs: every rank has a GPU of its own and NCCL is available"}
    shared = choices["shared"]
    assert shared["how"] == "fastest measured at start-up" and shared["algorithm"] not in ("nccl", "gloo", "torch")
    assert shared["not_nccl"].startswith("ranks 0 and 1 on ") and "share GPU 0" in shared["not_nccl"]
    if "no_nccl" in choices:   # a torch build without NCCL (this project's CPU build)
        assert "has no NCCL" in choices["no_nccl"]["not_nccl"]
    assert "not_nccl" not in choices["cpu"]   # on CPUs nccl is not a candidate: nothing to explain


def test_nccl_on_the_cpu_is_refused_naming_gloo():
    with pytest.raises(ConfigError, match="nccl reduces tensors on GPUs and this rank computes on the CPU: name gloo"):
        TrainConfig(train="t", val="v", allreduce="nccl", device="cpu")
    proc = invoke_dimd("train", "t", "--val", "v", "--allreduce", "nccl", "--device", "cpu")
    assert proc.returncode == 2
    assert "Invalid value for '--allreduce': nccl reduces tensors on GPUs and this rank computes on the CPU: name " \
           "gloo (the same path on the CPU) or a host algorithm" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: nccl would run")
def test_nccl_where_a_rank_computes_on_the_cpu_is_one_line_before_the_data_loads(packed_sample):
    proc = invoke_dimd("train", packed_sample, "--val", packed_sample, "--model", "lenet", "--image-size", "32",
                       "--epochs", "1", "--allreduce", "nccl")   # --device auto finds no GPU: the CPU
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["dimd: error: nccl reduces tensors on GPUs and this rank computes on the CPU: name gloo (the "
                     "same path on the CPU) or a host algorithm"], proc.stderr
    assert "loaded" not in proc.stdout   # refused before the load


def test_a_torch_build_without_nccl_is_named_in_one_line(monkeypatch):
    import torch.distributed as dist

    from dimd.allreduce import backend_problem

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    problem = backend_problem("nccl", torch.device("cuda", 0))
    assert problem.startswith(f"this torch build ({torch.__version__}) has no NCCL") and "\n" not in problem
    assert backend_problem("gloo", torch.device("cpu")) is None


def test_torch_without_a_group_of_the_callers_is_one_line_before_the_data_loads(packed_sample):
    proc = invoke_dimd("train", packed_sample, "--val", packed_sample, "--model", "lenet", "--image-size", "32",
                       "--epochs", "1", "--allreduce", "torch", "--device", "cpu")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dimd: error: allreduce algorithm 'torch' needs torch.distributed.init_process_group(...) first (gloo for "
        "CPU tensors, nccl for CUDA ones)"], proc.stderr
    assert "loaded" not in proc.stdout
