"""Shared fixtures: the sample tree, packed sets, and running real MPI ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
DIMD = [sys.executable, "-m", "dimd"]


def run_dimd(*args: str, check: bool = False, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run ``dimd ARGS`` as a user would, in a fresh process."""
    proc = subprocess.run([*DIMD, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"dimd {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def run_mpi(n: int, *args: str, timeout: float = 240, check: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n N ARGS`` (e.g. a dimd command or a Python script) on real ranks.

    A job that hangs fails the test through ``timeout`` instead of blocking it.
    """
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([MPIEXEC, "-n", str(n), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"mpiexec -n {n} {' '.join(map(str, args))} failed "
                             f"({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_mpi_dimd(n: int, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return run_mpi(n, *DIMD, *args, **kwargs)


@pytest.fixture(scope="session")
def sample_tree(tmp_path_factory) -> Path:
    """A small class-tree of real JPEGs (4 classes x 12 images, some > 1000 px)."""
    from dimd.sample_data import SampleSpec, generate

    root = tmp_path_factory.mktemp("sample") / "train"
    generate(SampleSpec(root=root, classes=4, per_class=12, seed=7, large_share=0.2), workers=2)
    return root


def pack_tree_as_is(root: Path, out: Path) -> Path:
    """Pack a class tree without re-encoding (the files' own JPEG bytes).

    Later stages test against this so they do not depend on ``dimd pack``'s
    resize path; ``out`` is the dataset stem (``out.dimd`` + ``out.idx.h5``).
    """
    from PIL import Image

    from dimd.format import PackedRecord, PackWriter

    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    with PackWriter(out) as writer:
        for label, name in enumerate(classes):
            for path in sorted((root / name).iterdir()):
                with Image.open(path) as image:
                    width, height = image.size
                writer.add(PackedRecord(path.read_bytes(), label, f"{name}/{path.name}",
                                        height, width))
        writer.commit(classes, short_side=0, quality=0, source=str(root))
    return out


@pytest.fixture(scope="session")
def packed_sample(sample_tree, tmp_path_factory) -> Path:
    """The sample tree as a packed data set stem (48 records, 4 classes)."""
    return pack_tree_as_is(sample_tree, tmp_path_factory.mktemp("packed") / "sample")


COLOURS = {"red": (200, 30, 30), "green": (30, 190, 40), "blue": (30, 40, 200), "grey": (128, 128, 128)}


@pytest.fixture(scope="session")
def colour_set(tmp_path_factory):
    """4 classes of 12 noisy solid-colour 16 px JPEGs: a set LeNet learns perfectly in a few dozen steps."""
    import io

    import numpy as np
    from PIL import Image

    from dimd.format import PackedRecord, PackWriter

    out = tmp_path_factory.mktemp("colours") / "colours"
    rng = np.random.default_rng(3)
    with PackWriter(out) as writer:
        for label, (name, rgb) in enumerate(COLOURS.items()):
            for i in range(12):
                pixels = np.clip(np.array(rgb) + rng.normal(0, 12, (16, 16, 3)), 0, 255).astype(np.uint8)
                data = io.BytesIO()
                Image.fromarray(pixels).save(data, format="JPEG", quality=90)
                writer.add(PackedRecord(data.getvalue(), label, f"{name}/{i}.jpg", 16, 16))
        writer.commit(list(COLOURS), short_side=16, quality=90, source="colours")
    return out
