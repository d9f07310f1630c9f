"""Sources read once, front to back (tars, WebDataset shards, Parquet): tasks that carry the bytes.

Such a source yields its tasks while it reads, in a background thread of the
worker pool, so reading, decoding and writing overlap; nothing is extracted.
Besides records (a member's bytes, :class:`~dimd.pack.tasks.BytesTask`, or,
for an uncompressed tar on a local disk, where the member lies,
:class:`~dimd.pack.tasks.RangeTask`) it yields a
:class:`~dimd.pack.tasks.SkipTask` for each member or archive that is not
packed and an :class:`~dimd.pack.tasks.ArchiveTask` as each archive starts.
They pass through the pool like the others, in order, so records, skips and
progress come out in the order the archives were read, for any number of
workers, and a problem met while reading is a skip (or, with ``strict``, the
error) at its place.

A source whose records must come out in another order than the archive's (the
extracted tree's, a list's) checks the order once every record is written and,
only if the archive was not in that order, has the writer put them in order
(:meth:`dimd.format.PackWriter.reorder`): the archive is still read once.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from dimd.format import PackWriter, escape_name
from dimd.pack.labels import LabelBound, numbered_classes
from dimd.pack.tasks import Task


def where(archive: str | os.PathLike, *inside: str) -> str:
    """How a message names a place in an archive: ``train.tar: n01440764.tar/x.JPEG``, ``shard.tar: key``,
    ``data.parquet: row 7``; the archive alone when ``inside`` is empty."""
    path = "/".join(part for part in inside if part)
    return f"{archive}: {path}" if path else str(archive)


@dataclass(frozen=True)
class SourceFile:
    """One file SRC names, as ``--json`` records it."""

    path: str
    bytes: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> "SourceFile":
        return cls(str(path), os.stat(path).st_size)


class StreamedSource(ABC):
    """A source read front to back once; subclasses yield the tasks and say what order the records take."""

    kind: str = ""
    #: "archive": records in the order they were read; "tree" or "list": put in that order at the end.
    record_order: str = "archive"

    def __init__(self, shown: str, files: Sequence[SourceFile], *, classes: list[str] | None,
                 count: int | None = None, archives: int | None = None) -> None:
        self.shown = shown              # SRC as messages name it
        self.files = list(files)
        self.classes = classes          # known up front, or None: decided by finish()
        self.count = count              # images, when known before reading (a list, Parquet metadata)
        self.archives = archives        # archives to read, when known before reading (else None)
        #: Found before any work and named as skips first (a shard named twice).
        self.rejected: list[tuple[str, str]] = []
        self.reordered = False

    #: Where ``classes`` came from, as a label out of range names it.
    classes_from = "the classes file"

    @property
    def label_bound(self) -> LabelBound:
        return LabelBound.for_classes(self.classes, self.classes_from)

    def label_problem(self, label: int) -> str | None:
        """Why a label read from the archive is refused (negative, or not a class), or None."""
        return self.label_bound.problem(label)

    @abstractmethod
    def tasks(self) -> Iterator[Task]:
        """The tasks, as the archives are read."""

    def finish(self, writer: PackWriter) -> list[str]:
        """The class names, once every record is written (labels numbered when no names were given)."""
        if self.classes is not None:
            return self.classes
        return numbered_classes(writer.labels, self.shown, lambda i: escape_name(writer.name(i)))

    def summary(self) -> dict[str, Any]:
        """What ``--json`` records of the source."""
        return {"sources": [{"path": f.path, "bytes": f.bytes} for f in self.files],
                "record_order": self.record_order, "reordered": self.reordered}


def put_in_order(writer: PackWriter, key: Callable[[int], Any]) -> bool:
    """Reorder the writer's records by ``key(i)`` if they are not in that order already; True if it did.

    The check is one pass that holds two keys; the keys of every record are
    built only when a reorder is needed.
    """
    count = len(writer)
    previous = None
    for i in range(count):
        current = key(i)
        if previous is not None and current < previous:
            break
        previous = current
    else:
        return False
    order = np.array(sorted(range(count), key=key), np.int64)
    writer.reorder(order)
    return True
