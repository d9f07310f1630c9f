"""Machine-readable results: one JSON object per run, with what produced it."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dimd import __version__
from dimd.fsutil import atomic_write_text


def library_versions() -> dict[str, str]:
    """Versions of what shaped the figures; heavy modules only if already loaded."""
    versions = {"dimd": __version__, "python": platform.python_version(), "numpy": np.__version__}
    for module in ("torch", "PIL", "h5py", "mpi4py"):
        if module in sys.modules:
            versions[module] = getattr(sys.modules[module], "__version__", "?")
    if "mpi4py.MPI" in sys.modules:
        versions["mpi"] = sys.modules["mpi4py.MPI"].Get_library_version().strip().splitlines()[0].strip()
    return versions


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
    return value


def result_document(command: str, parameters: Any, figures: dict[str, Any], *,
                    mpi: Any = None) -> dict[str, Any]:
    """The standard envelope: command, parameters, environment, then the figures."""
    doc: dict[str, Any] = {
        "command": command,
        "parameters": to_jsonable(parameters),
        "versions": library_versions(),
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if mpi is not None:
        doc["mpi"] = to_jsonable(mpi)
    doc.update(to_jsonable(figures))
    return doc


def write_json(path: str | os.PathLike, document: dict[str, Any]) -> None:
    """Write ``document`` atomically (a reader never sees half a file)."""
    atomic_write_text(path, json.dumps(to_jsonable(document), indent=2) + "\n")
