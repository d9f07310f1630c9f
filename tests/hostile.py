"""Images and trees for the tests, and what "handled well" means for bad input, checked the same way everywhere.

Handled well: a non-zero exit with exactly one line on stderr, ``dimd: error:
<the file> ...: <the problem>``, no traceback, no temporaries left behind.
"""

from __future__ import annotations

import functools
import io
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

from dimd.format import PackedDataset


def one_error_line(proc: subprocess.CompletedProcess, code: int = 1) -> str:
    """The single ``dimd: error:`` line of a failed run (MPI's own abort notice aside)."""
    lines = [line for line in proc.stderr.splitlines()
             if line.strip() and not line.startswith(("Abort(", "application called MPI_Abort"))]
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dimd: error: "), lines[0]
    return lines[0][len("dimd: error: "):].removeprefix("rank 0: ")


def mpi_error(proc: subprocess.CompletedProcess) -> str:
    """An MPI job's one error message: printed by rank 0 (another rank may repeat it if the abort is slow),
    whatever the launcher adds (MPICH's abort notice, Open MPI's box about a non-zero exit)."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    messages = {re.sub(r"^dimd: error: (rank \d+: )?", "", line)
                for line in proc.stderr.splitlines() if line.startswith("dimd: error:")}
    assert len(messages) == 1, proc.stderr
    return messages.pop()


def temporaries(folder: Path) -> list[str]:
    """Hidden temporaries (``.NAME.tmp-HOST-PID``, probe files) anywhere under ``folder``."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*")
                  if ".tmp-" in p.name or p.name.startswith(".dimd-probe-"))


def jpeg(size: tuple[int, int], colour=(200, 30, 30), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else colour[0]).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def small_tree(root: Path, classes: dict[str, int], size: tuple[int, int] = (64, 48)) -> Path:
    """``root/<class>/<i>.jpg`` with distinct solid colours; returns ``root``."""
    for c, (name, count) in enumerate(classes.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            (root / name / f"{i}.jpg").write_bytes(jpeg(size, (40 * c % 256, 20 * i % 256, 90)))
    return root


@functools.cache   # one unshare probe per test session, however many modules ask
def can_mount_tmpfs() -> bool:
    """Whether ``unshare --mount`` with a private tmpfs works here (root, or user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def in_tmpfs(mount: Path, size: str, script: str, *, read_only: bool = False,
             timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``sh -c script`` in a private mount namespace where ``mount`` is a fresh tmpfs of ``size``.

    The file system exists only for that shell: nothing to clean up, nothing
    seen by other processes. The script's last line should print what the test
    inspects (e.g. ``ls -A``), since the tmpfs vanishes with it.
    """
    mount.mkdir(parents=True, exist_ok=True)
    setup = f"mount -t tmpfs -o size={size} tmpfs {mount}"
    if read_only:
        setup += f" && mkdir -p {mount}/out && mount -o remount,ro {mount}"
    return subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", f"{setup} && {script}"],
                          capture_output=True, text=True, timeout=timeout)


def decode(ds: PackedDataset, i: int) -> np.ndarray:
    """Record ``i`` of a packed set as RGB pixels."""
    return np.asarray(Image.open(io.BytesIO(ds.record(i))).convert("RGB"))


def solid(size: tuple[int, int], colour, mode: str = "RGB") -> Image.Image:
    """One colour, converted to ``mode``."""
    return Image.new("RGB", size, colour).convert(mode)
