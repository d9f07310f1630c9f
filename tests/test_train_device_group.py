"""Which allreduce `dimd train` takes on GPUs, and what it refuses: NCCL where every rank has a GPU of its own."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import invoke_dimd, mpi_run
from mpi_case import case, say, world

from dimd.errors import ConfigError
from dimd.train.config import TrainConfig


@case
def gpus_as_clusters_hand_them_out() -> None:
    """The GPU each rank takes, and ``dimd train``'s choice of allreduce, with CUDA faked: torch.cuda said to
    have the GPUs a layout gives each rank, each known by a made-up UUID, and NCCL said to be there. Layouts:
    one GPU bound to each rank (every rank's is cuda:0), every GPU visible to every rank, and one GPU for two
    ranks. Rank 0 prints one JSON line per case with every rank's answer::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py gpus_as_clusters_hand_them_out
    """
    import torch
    import torch.distributed as dist

    import dimd.gpus
    from dimd.mpi import AgreedError
    from dimd.train.config import TrainConfig
    from dimd.train.hardware import pick_device
    from dimd.train.run_plan import choose_allreduce

    comm = world()
    rank = comm.Get_rank()
    torch.cuda.is_available = lambda: True
    torch.cuda.set_device = lambda device: None

    def layout(visible: list[str]) -> None:
        """This rank sees ``visible`` (UUIDs, cuda:0 first)."""
        torch.cuda.device_count = lambda: len(visible)
        dimd.gpus.gpu_identity = lambda device: visible[device if isinstance(device, int) else device.index]

    def picked() -> str:
        try:
            return str(pick_device("cuda", comm))
        except AgreedError as exc:
            return f"refused: {exc}"

    cases: dict[str, object] = {}
    layout([f"GPU-{rank}"])   # srun --gpus-per-task=1
    cases["bound"] = picked()
    layout(["GPU-0", "GPU-1"])
    cases["all_visible"] = picked()
    layout(["GPU-0"])
    cases["too_few"] = picked()

    config = TrainConfig(train="unused", val="unused")
    build_has_nccl = dist.is_nccl_available()
    dist.is_nccl_available = lambda: True
    try:
        layout([f"GPU-{rank}"])
        cases["own"] = choose_allreduce(config, 4096, comm, torch.device("cuda", 0))
        layout(["GPU-0"])
        cases["shared"] = choose_allreduce(config, 4096, comm, torch.device("cuda", 0))
    finally:
        dist.is_nccl_available = lambda: build_has_nccl
    if not build_has_nccl:
        layout([f"GPU-{rank}"])
        cases["no_nccl"] = choose_allreduce(config, 4096, comm, torch.device("cuda", 0))
    cases["cpu"] = choose_allreduce(config, 4096, comm, torch.device("cpu"))
    every_rank = comm.gather(cases)
    if rank == 0:
        for name in cases:
            say(json.dumps({"case": name, "ranks": [answers[name] for answers in every_rank]}))


@pytest.fixture(scope="module")
def gpu_layouts() -> dict[str, list]:
    proc = mpi_run(gpus_as_clusters_hand_them_out, 2, timeout=120, check=True)
    return {line["case"]: line["ranks"] for line in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.mpi
def test_each_rank_takes_a_gpu_of_its_own_whether_bound_to_it_or_seeing_them_all(gpu_layouts):
    assert gpu_layouts["bound"] == ["cuda:0", "cuda:0"]         # one GPU per rank, as SLURM binds them
    assert gpu_layouts["all_visible"] == ["cuda:0", "cuda:1"]   # by node-local rank
    too_few = gpu_layouts["too_few"]
    assert too_few[0] == too_few[1] and too_few[0].startswith("refused: 2 ranks on ")
    assert too_few[0].endswith(" and 1 GPU(s) they can see: rank(s) 1 would share a GPU; start at most one rank "
                               "per GPU (SLURM: --gpus-per-task=1), or use `device` cpu")


@pytest.mark.mpi
def test_nccl_is_the_default_where_every_rank_has_a_gpu_of_its_own_and_the_json_says_why_not_elsewhere(gpu_layouts):
    """Every rank at cuda:0 but on GPUs of their own: nccl. On one GPU: the fastest host algorithm, and why."""
    for algorithm, choice in gpu_layouts["own"]:
        assert (algorithm, choice) == ("nccl", {
            "how": "the default on GPUs: every rank has a GPU of its own and NCCL is available"})
    (algorithm, shared), _ = gpu_layouts["shared"]
    assert shared["how"] == "fastest measured at start-up" and algorithm not in ("nccl", "gloo", "torch")
    assert re.fullmatch(r"ranks 0 and 1 on \S+ share GPU GPU-0: nccl needs a GPU of its own for each rank; start "
                        r"at most one rank per GPU", shared["not_nccl"]), shared["not_nccl"]
    if "no_nccl" in gpu_layouts:   # a torch build without NCCL (this project's CPU build)
        assert "has no NCCL" in gpu_layouts["no_nccl"][0][1]["not_nccl"]
    assert "not_nccl" not in gpu_layouts["cpu"][0][1]   # on CPUs nccl is not a candidate: nothing to explain


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
