"""What killed or aborted MPI jobs left behind: shared-memory files and MPICH's hydra topology files.

MPICH unlinks most of its segments once every local rank has attached, and
keeps one per node (``mpich_shm_*_0``) for the job's life, unlinked in
``MPI_Finalize``; Open MPI removes its own at the job's end (and now and then
not even then: its PMIx clean-up is known to miss some). A job whose ranks are
killed or aborted before that, as the tests that end jobs do, leaves them
behind, 1-16 MB of memory each, until the machine restarts (``dimd.mpi.init_mpi``
unlinks MPICH's per-node file once every rank of the node has mapped it, so
dimd's own jobs leave none).
MPICH's hydra also leaves a 5.5 KB ``/tmp/hydra_hwloc_xmlfile_*`` behind every
job that ends in ``MPI_Abort``. The test session (``conftest.pytest_sessionfinish``)
and ``tests/openmpi/run.sh`` remove those made since they started that no
process maps or holds open any more.
Standard library only: run.sh calls it with any Python 3::

    python3 tests/mpi_segments.py SINCE     # SINCE: seconds since the epoch
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
from pathlib import Path

#: The files the MPIs the tests run leave: MPICH's and Open MPI's (``tests/openmpi/run.sh``) shared memory,
#: and MPICH hydra's topology file (its path is fixed: TMPDIR does not move it).
MPI_LEFTOVERS = ((Path("/dev/shm"), "mpich_shm_*"), (Path("/dev/shm"), "sm_segment.*"),
                 (Path("/tmp"), "hydra_hwloc_xmlfile_*"))


def in_use() -> set[str]:
    """Every file some process maps or holds open."""
    used = set()
    for process in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            fields = (line.split(maxsplit=5) for line in (process / "maps").read_text().splitlines())
            used.update(parts[5] for parts in fields if len(parts) == 6)   # the mapped file's path
        with contextlib.suppress(OSError):
            for fd in (process / "fd").iterdir():
                with contextlib.suppress(OSError):
                    used.add(os.readlink(fd))
    return used


def descendants(root: int) -> set[int]:
    """``root`` and every process below it, alive now (read from /proc's children lists)."""
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        tasks: list[Path] = []
        with contextlib.suppress(OSError):   # a process that ended meanwhile has no tasks to list
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        for task in tasks:
            with contextlib.suppress(OSError, ValueError):
                todo.extend(int(child) for child in (task / "children").read_text().split())
    return found


def held_by(root: int, pattern: str = "/tmp/hydra_hwloc_xmlfile_*") -> set[str]:
    """The files matching ``pattern`` that ``root`` or a process below it holds open (MPICH's hydra proxy holds
    its topology file open for the job's life, so a test can tell its own job's file from another job's)."""
    held = set()
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if fnmatch.fnmatch(target, pattern):
                        held.add(target)
    return held


def leftover_mpi_segments(since: float) -> list[Path]:
    """The MPIs' leftover files made since ``since`` that no process maps or holds open any more."""
    candidates = []
    for folder, pattern in MPI_LEFTOVERS:
        for path in folder.glob(pattern):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime >= since - 1:
                    candidates.append(path)
    if not candidates:
        return []
    used = in_use()
    return [path for path in candidates if str(path) not in used]


def remove_leftover_mpi_segments(since: float) -> None:
    for path in leftover_mpi_segments(since):
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    remove_leftover_mpi_segments(float(sys.argv[1]))
