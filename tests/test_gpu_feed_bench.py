"""bench/gpu_feed.py, bench/gpu_allreduce.py and bench/probes/pinned_feed.py: one command on a GPU machine, one
line and exit status 2 anywhere else."""

import json

import pytest
import torch

from conftest import BENCH, run_python


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
@pytest.mark.parametrize("script", ["gpu_feed.py", "gpu_allreduce.py"])
def test_the_gpu_benchmark_says_in_one_line_that_it_needs_cuda_and_exits_2(script):
    proc = run_python(BENCH / script, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "no CUDA device" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
def test_the_pinned_copy_benchmark_says_in_one_line_that_it_needs_cuda_and_exits_2(packed_sample):
    proc = run_python(BENCH / "probes" / "pinned_feed.py", packed_sample, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no CUDA device" in proc.stderr


def test_the_pinned_copy_benchmark_measures_its_ways_through_the_real_feed_on_the_cpu(packed_sample, tmp_path):
    out = tmp_path / "pinned.json"
    run_python(BENCH / "probes" / "pinned_feed.py", packed_sample, "--device", "cpu", "--runs", "1", "--epochs", "2",
               "--image-size", "24", "--batch-size", "8", "--workers", "1", "--json", out, check=True, timeout=200)
    figures = json.loads(out.read_text())["result"]["figures"]
    for way in ("copy", "copy, thread"):
        assert figures[f"{way}|alone|images_per_s"]["median"] > 0
        assert figures[f"{way}|alone|main_cpu_ms_per_batch"]["median"] > 0
    assert figures["copy, thread / copy|alone|images_per_s"]["median"] > 0
