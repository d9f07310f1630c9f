"""Machine-readable results: one JSON envelope per run, the figures under one key.

Every ``--json`` a command writes, and every result a ``bench/`` script
writes, has the same shape::

    {"command": ..., "parameters": {...}, "versions": {...}, "mpi": {...} | null,
     "commit": "3f2a9c1d0b7e" | "3f2a9c1d0b7e-dirty" | null, "date": ..., "host": ...,
     "result": {...the figures...}}

The figures live under :data:`RESULT_KEY` only, so a figure can never
overwrite an envelope field, and ``commit`` ties a result to the code that
made it. :func:`read_result` is the reader a later pipeline step uses.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

import dimd
from dimd.errors import DimdError
from dimd.fsutil import atomic_write_text

RESULT_KEY = "result"


def library_versions() -> dict[str, str]:
    """Versions of what shaped the figures; heavy modules only if already loaded."""
    versions = {"dimd": dimd.__version__, "python": platform.python_version(), "numpy": np.__version__}
    for module in ("torch", "PIL", "h5py", "mpi4py"):
        if module in sys.modules:
            versions[module] = getattr(sys.modules[module], "__version__", "?")
    if "mpi4py.MPI" in sys.modules:
        from dimd.mpi import library_version

        versions["mpi"] = library_version()
    return versions


@functools.lru_cache(maxsize=1)
def source_commit() -> str | None:
    """The git commit of the dimd source that is running ("-dirty" if it has local edits).

    None when dimd does not run from a git checkout (a wheel install) or git is missing.
    """
    source = Path(__file__).resolve().parent
    try:
        proc = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=source,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def to_jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and not np.isfinite(value):
        return None  # JSON has no inf/nan; a reader must not choke on dimd's output
    return value


def result_document(command: str, parameters: Any, result: Any, *, mpi: Any = None) -> dict[str, Any]:
    """The standard envelope around ``result`` (a dataclass or a dict of figures)."""
    return {
        "command": command,
        "parameters": to_jsonable(parameters),
        "versions": library_versions(),
        "mpi": to_jsonable(mpi),
        "commit": source_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        RESULT_KEY: to_jsonable(result),
    }


def write_json(path: str | os.PathLike, document: dict[str, Any]) -> None:
    """Write ``document`` atomically (a reader never sees half a file)."""
    atomic_write_text(path, json.dumps(to_jsonable(document), indent=2) + "\n")


def read_result(path: str | os.PathLike, command: str | Iterable[str] | None = None) -> dict[str, Any]:
    """Read a result envelope, checking it came from ``command``; a one-line error otherwise."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DimdError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DimdError(f"{path}: not a readable JSON result ({exc})") from None
    if not isinstance(document, dict) or RESULT_KEY not in document or "command" not in document:
        raise DimdError(f"{path}: not a dimd result (no 'command' and '{RESULT_KEY}' fields)")
    wanted = (command,) if isinstance(command, str) else tuple(command or ())
    if wanted and document["command"] not in wanted:
        raise DimdError(f"{path}: a result of `{document['command']}`, expected one of `"
                        + "`, `".join(wanted) + "`")
    return document


def spread(values: Iterable[float]) -> dict[str, Any]:
    """Median, minimum, maximum and the runs themselves: how dimd reports repeated measurements."""
    runs = [float(v) for v in values]
    if not runs:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": float(np.median(runs)), "min": min(runs), "max": max(runs), "runs": runs}
