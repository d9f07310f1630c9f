"""bench/gpu_feed.py: one command on a GPU machine, one line and exit status 2 anywhere else."""


import pytest
import torch

from conftest import BENCH, run_python


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
def test_the_gpu_benchmark_says_in_one_line_that_it_needs_cuda_and_exits_2():
    proc = run_python(BENCH / "gpu_feed.py", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "no CUDA device" in proc.stderr
