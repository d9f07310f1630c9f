"""Write files so that a crash never leaves one that looks complete."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


def temporary_sibling(path: Path) -> Path:
    """A name beside ``path`` that no reader mistakes for the real file."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path; rename it onto ``path`` only if the block succeeds."""
    target = Path(path)
    tmp = temporary_sibling(target)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
