"""The examples run as a user runs them, and do what they say."""

import json
import sys
from pathlib import Path

import pytest
from conftest import run_mpi

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.mpi
def test_own_loop_learns_under_mpiexec(colour_set, tmp_path):
    out = tmp_path / "own_loop.json"
    run_mpi(2, sys.executable, EXAMPLES / "own_loop.py", colour_set, "--val", colour_set, "--epochs", "3",
            "--batch-size", "4", "--image-size", "16", "--json", out, timeout=240, check=True)
    doc = json.loads(out.read_text())
    assert doc["command"] == "examples/own_loop.py" and doc["result"]["world_size"] == 2
    assert doc["result"]["val_top1"] >= 0.5          # 4 colours: chance is 0.25
    assert doc["result"]["images_per_s"] > 0
