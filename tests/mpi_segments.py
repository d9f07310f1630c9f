"""The MPIs' shared-memory files a killed or aborted job left in /dev/shm, and their removal.

MPICH unlinks its segment once every local rank has attached, Open MPI at the
job's end (and now and then not even then: its PMIx clean-up is known to miss
some); a job whose ranks are killed or aborted before that, as the tests that
end jobs do, leaves it behind, 1-16 MB of memory each, until the machine
restarts. The test session (``conftest.pytest_sessionfinish``) and
``tests/openmpi/run.sh`` remove those made since they started that no process
maps any more. Standard library only: run.sh calls it with any Python 3::

    python3 tests/mpi_segments.py SINCE     # SINCE: seconds since the epoch
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

#: The shared-memory files of the MPIs the tests run: MPICH's, and Open MPI's (``tests/openmpi/run.sh``).
MPI_SEGMENTS = ("mpich_shm_*", "sm_segment.*")


def leftover_mpi_segments(since: float) -> list[Path]:
    """The MPIs' files in /dev/shm made since ``since`` that no process maps any more."""
    candidates = [path for pattern in MPI_SEGMENTS for path in Path("/dev/shm").glob(pattern)
                  if path.stat().st_mtime >= since - 1]
    if not candidates:
        return []
    mapped = ""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped += maps.read_text()
    return [path for path in candidates if str(path) not in mapped]


def remove_leftover_mpi_segments(since: float) -> None:
    for path in leftover_mpi_segments(since):
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    remove_leftover_mpi_segments(float(sys.argv[1]))
