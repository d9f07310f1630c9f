"""What ``dimd pack`` does, as a frozen config: the only defaults, checked once.

Kept apart from the packer so the CLI can build options from it without
importing Pillow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dimd.checks import at_least, in_range

#: libjpeg's JPEG_MAX_DIMENSION: no side of a stored JPEG may be longer.
JPEG_MAX_SIDE = 65500


@dataclass(frozen=True)
class PackConfig:
    src: Path
    out: str | Path   # the stem as given: a trailing / (a folder, refused) survives only in a str
    list_file: Path | None = None
    classes_file: Path | None = None
    short_side: int = 256
    quality: int = 90
    workers: int | None = None  # None: the cores this process may use
    strict: bool = False
    force: bool = False
    chunksize: int = 16  # tasks per message to and from a worker

    def __post_init__(self) -> None:
        in_range(self, "short_side", 1, JPEG_MAX_SIDE)
        in_range(self, "quality", 1, 100)
        at_least(self, "workers", 1, optional=True)
        at_least(self, "chunksize", 1)
