"""Sources read once, front to back (tars, WebDataset shards, Parquet): tasks that carry the bytes.

Such a source yields its tasks while it reads, in a background thread of the
worker pool, so reading, decoding and writing overlap; nothing is extracted.
Besides the folder sources' tasks it yields:

* ``"bytes"``: a member's bytes; the payload is ``(data, shown)``, where
  ``shown`` names the member inside its archive for a skip
  (``train.tar: n01440764.tar/n01440764_10026.JPEG``);
* ``"range"``: where a member of an uncompressed tar on a local disk lies,
  ``(path, offset, size, shown)``: the worker reads it in place (``pread``),
  as it reads a file, so its bytes never pass through this process;
* ``"skip"``: a member or an archive that is not packed; the payload is the reason;
* ``"archive"``: the next archive starts (for progress).

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

Task = tuple  # (name, label, kind, payload), as in dimd.pack.sources


def bytes_task(name: str, label: int, data: bytes, shown: str) -> Task:
    return name, label, "bytes", (data, shown)


def range_task(name: str, label: int, path: str, offset: int, size: int, shown: str) -> Task:
    return name, label, "range", (path, offset, size, shown)


def skip_task(shown: str, reason: str) -> Task:
    return shown, -1, "skip", reason


def archive_task(shown: str) -> Task:
    return shown, -1, "archive", None


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
        self.archives = archives        # archives to read, when known before reading
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
