"""What ``dimd pack`` does, as a frozen config: the only defaults, checked once.

Kept apart from the packer so the CLI can build options from it without
importing Pillow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dimd.checks import at_least, in_range
from dimd.errors import ConfigError

#: libjpeg's JPEG_MAX_DIMENSION: no side of a stored JPEG may be longer.
JPEG_MAX_SIDE = 65500


@dataclass(frozen=True)
class SizeLimit:
    """The most bytes one kind of input may have: a larger one is not read (it would be read whole into
    memory), and its skip names what was measured against which limit."""

    what: str
    most: int

    def problem(self, size: int) -> str | None:
        """Why an input of ``size`` bytes is skipped, or None."""
        if size <= self.most:
            return None
        return f"{size:,} bytes, more than {self.what} may have ({self.most:,})"


#: A file, archive member or Parquet cell larger than this is not read as an image.
IMAGE_SIZE = SizeLimit("an image file", 1 << 30)
#: A WebDataset label member larger than this is not read as a label.
LABEL_SIZE = SizeLimit("a label member (KEY.cls or KEY.json)", 1 << 20)


@dataclass(frozen=True)
class PackConfig:
    #: One SRC (a folder, an LMDB, a tar, a Parquet file, a pattern such as ``train-{000000..000146}.tar``,
    #: a file listing shards), or several (WebDataset shards, Parquet files).
    src: Path | tuple[Path, ...]
    out: str | Path   # the stem as given: a trailing / (a folder, refused) survives only in a str
    list_file: Path | None = None
    classes_file: Path | None = None
    label_field: str = "label"      # WebDataset: the field of KEY.json that holds the label
    image_column: str = "image"     # Parquet: an image struct (with `bytes`) or a binary column
    label_column: str = "label"     # Parquet: an integer column
    short_side: int = 256
    quality: int = 90
    workers: int | None = None  # None: the cores this process may use
    strict: bool = False
    force: bool = False
    chunksize: int = 16  # tasks per message to and from a worker

    def __post_init__(self) -> None:
        if isinstance(self.src, tuple) and not self.src:
            raise ConfigError("src", "needs at least one source")
        for name in ("label_field", "image_column", "label_column"):
            if not getattr(self, name):
                raise ConfigError(name, "must not be empty")
        in_range(self, "short_side", 1, JPEG_MAX_SIDE)
        in_range(self, "quality", 1, 100)
        at_least(self, "workers", 1, optional=True)
        at_least(self, "chunksize", 1)

    @property
    def sources(self) -> tuple[Path, ...]:
        """SRC as a tuple of paths (patterns not yet expanded)."""
        return tuple(Path(p) for p in self.src) if isinstance(self.src, tuple) else (Path(self.src),)

    @property
    def shown_src(self) -> str:
        """SRC as messages and the index's ``source`` attribute show it."""
        return " ".join(str(p) for p in self.sources)
